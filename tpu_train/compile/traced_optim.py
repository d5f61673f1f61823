"""Any ``torch.optim.Optimizer`` in the compiled step, by tracing its own ``step()``.

:class:`TracedOptimizerAdapter` fits the :class:`~.functional_optim.OptimizerAdapter`
interface: inside the update graph's trace (``make_fx`` over functionalized fake tensors) it
runs the user's optimizer's own ``step()`` on a *shadow* of the optimizer — same class, same
attributes, same hyper-parameters, but holding the traced parameters (with the traced
gradients as ``.grad``) and the traced state tensors. Functionalization turns the in-place
updates into graph outputs; the new parameter and state values are read back from the shadow.
The user's optimizer object is never modified by tracing.

What is fed how:

* **learning rate**: a 0-dim float32 program input (host scalar column 0) put into the shadow's
  ``param_groups[i]["lr"]``, so LR schedulers never recompile. Code that passes it where torch
  wants a Python number (``p.add_(g, alpha=-lr)``, ``addcdiv_(..., value=-lr)``) is rewritten
  into tensor arithmetic by :class:`_TensorScalars` (same values, one rounding apart).
* **step counters** (``state[p]["step"]`` tensors): kept where torch keeps them (the CPU unless
  ``capturable``/``fused``) and advanced by the host like the hand-written adapters do; the
  program receives the count before the update (host scalar column 1) as the shadow's
  ``step``, so ``step()`` computes bias corrections from it on the device.
* **other state tensors**: program inputs and outputs, written back to the same storages.
  A 0-dim state tensor that torch keeps on the CPU (NAdam's ``mu_product`` without
  ``capturable``) lives on the parameter's device instead: a program input must.
* **other hyper-parameters** (betas, eps, momentum, weight decay, flags...): baked into the
  program and part of the compile signature; changing one recompiles and the log names it.

The shadow's ``foreach`` is False (the per-tensor path: one small chain per parameter, all
inside one XLA program anyway), ``fused`` False, ``capturable`` True (the path that keeps
step-dependent arithmetic in tensors instead of ``.item()``), ``differentiable`` False; the
trace also answers ``torch.compiler.is_compiling()`` True, which torch's optimizers read to
keep step values as tensors. The optimizer's own step hooks (``register_step_pre_hook``...)
are not run; global ones (``register_optimizer_step_pre_hook``) run inside the trace.

**State initialisation.** torch creates state lazily in the first ``step()``. Before the first
compiled step, :meth:`TracedOptimizerAdapter._initialise` traces one ``step()`` of the shadow
with empty state and records every state entry's value *at the moment it is assigned* (before
the update mutates it); the recorded values form a small graph of the parameters alone (the
update itself is dead code and removed), which runs once on the device. Nothing is updated and
no eager optimizer step runs. State whose first value depends on the gradient (SGD's momentum
buffer is ``grad.clone()`` on the first step) cannot be created before the first gradient
exists: that raises :class:`~.functional_optim.UnsupportedOptimizerError` (``torch.optim.SGD``
itself takes the hand-written adapter).
"""

from __future__ import annotations

import collections
from typing import Sequence

import jax
import torch
from torch.overrides import TorchFunctionMode

from tpu_train.compile import interpreter, tracing
from tpu_train.compile.functional_optim import (OptimizerAdapter, StepCounters,
                                                UnsupportedOptimizerError, _scalar)
from tpu_train.device.tensor import TpuTensor, to_host, wrap

__all__ = ["TracedOptimizerAdapter"]

STEP = "step"
# Group flags forced on the shadow (only where the optimizer has them), see the docstring.
_TRACED_FLAGS = {"foreach": False, "fused": False, "capturable": True, "differentiable": False}


def _host_value(value):
    """A hyper-parameter as the trace should see it: 1-element tensors as Python floats."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UnsupportedOptimizerError(
                f"a param group holds a tensor hyper-parameter of shape {tuple(value.shape)}; "
                "the compiled step bakes hyper-parameters other than lr as numbers")
        return _scalar(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_host_value(v) for v in value)
    return value


def _frozen(value):
    """A hashable form of a hyper-parameter for the compile signature."""
    value = _host_value(value)
    if isinstance(value, (tuple, list)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


# -- tensors where torch wants a number --------------------------------------------------------

def _scaled(values, factor):
    if isinstance(values, (list, tuple)):
        return [v * factor for v in values]
    return values * factor


def _rewrite_alpha(func, args, kwargs, alpha):
    # add(x, y, alpha=a) == add(x, y * a); the same for sub and the _foreach_ forms.
    return func(args[0], _scaled(args[1], alpha), *args[2:], **kwargs)


def _rewrite_value(func, args, kwargs, value):
    # addcdiv(x, t1, t2, value=v) == x + v * t1 / t2 (torch's kernels compute v * t1 first);
    # addcmul(x, t1, t2, value=v) == x + v * t1 * t2.
    name = func.__name__
    self, t1, t2 = args[:3]
    divide = "addcdiv" in name
    if name.startswith("_foreach_"):
        term = [(value * a) / b if divide else (value * a) * b for a, b in zip(t1, t2)]
        return getattr(torch, "_foreach_add_" if name.endswith("_") else "_foreach_add")(self, term)
    term = (value * t1) / t2 if divide else (value * t1) * t2
    return self.add_(term) if name.endswith("_") else torch.add(self, term)


_ALPHA_NAMES = frozenset({"add", "add_", "sub", "sub_", "_foreach_add", "_foreach_add_",
                          "_foreach_sub", "_foreach_sub_"})
_VALUE_NAMES = frozenset({"addcdiv", "addcdiv_", "addcmul", "addcmul_", "_foreach_addcdiv",
                          "_foreach_addcdiv_", "_foreach_addcmul", "_foreach_addcmul_"})


_NO_RANGE = object()  # what a dropped profiler range's enter returns


class _TensorScalars(TorchFunctionMode):
    """Drops profiler ranges and rewrites ``alpha=`` / ``value=`` given a 0-dim tensor (the traced lr, or a value derived
    from it) into tensor arithmetic.

    torch would turn such a tensor into a Python number (``.item()``), which a traced value
    does not have. The mode sees the call before that conversion, so the optimizer's own code
    runs unchanged.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("profiler."):  # torch.ops.profiler.* (packet or overload)
            # The profiler range Optimizer's step() wrapper opens (also around a parent's
            # step() that a subclass calls): its ops would be graph nodes with no lowering,
            # and a range means nothing inside a traced program. The exit only checks that
            # the enter gave it something.
            return _NO_RANGE
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        for key, names, rewrite in (("alpha", _ALPHA_NAMES, _rewrite_alpha),
                                    ("value", _VALUE_NAMES, _rewrite_value)):
            scalar = kwargs.get(key)
            if name in names and isinstance(scalar, torch.Tensor) and scalar.dim() == 0:
                del kwargs[key]
                return rewrite(func, args, kwargs, scalar)
        return func(*args, **kwargs)


# -- the shadow optimizer ----------------------------------------------------------------------

def _shadow(optimizer: torch.optim.Optimizer, group: dict, params: list, state,
            lr) -> torch.optim.Optimizer:
    """An optimizer of the same class and attributes holding ``params`` and ``state`` only."""
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update(optimizer.__dict__)
    # Step hooks are the user's eager-side callbacks (logging, host reads): not traced.
    shadow._optimizer_step_pre_hooks = collections.OrderedDict()
    shadow._optimizer_step_post_hooks = collections.OrderedDict()
    shadow_group = {key: _host_value(value) for key, value in group.items()
                    if key not in ("params", "lr")}
    shadow_group["params"] = params
    shadow_group["lr"] = lr
    defaults = dict(getattr(optimizer, "defaults", {}))
    for flag, value in _TRACED_FLAGS.items():
        if flag in shadow_group:
            shadow_group[flag] = value
        if flag in defaults:
            defaults[flag] = value  # step()'s wrapper reads defaults["differentiable"]
    shadow.defaults = defaults
    shadow.param_groups = [shadow_group]
    shadow.state = state
    return shadow


def _run_step(optimizer: torch.optim.Optimizer, shadow: torch.optim.Optimizer) -> None:
    try:
        with _TensorScalars():
            # The class's step: an instance attribute ``step`` is the user's optimizer's own
            # bound method (LR schedulers wrap ``optimizer.step`` per instance).
            type(shadow).step(shadow)
    except Exception as error:  # the optimizer's own code: name it and keep the cause
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__}.step() could not be traced into the compiled step "
            f"({type(error).__name__}: {error}); it must be traceable: no .item() or Python "
            "branches on tensor values, lr used as a number only through torch ops") from error


class _FirstValues(dict):
    """One parameter's optimizer state that remembers each entry's value when first set."""

    def __init__(self):
        super().__init__()
        self.first: dict = {}

    def __setitem__(self, key, value):
        if key not in self.first:
            self.first[key] = value.clone() if isinstance(value, torch.Tensor) else value
        super().__setitem__(key, value)

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]


class _RecordingState(collections.defaultdict):
    """``optimizer.state`` whose per-parameter dicts are :class:`_FirstValues`."""

    def __init__(self):
        super().__init__(_FirstValues)

    def __setitem__(self, param, value):
        if not isinstance(value, _FirstValues):  # ``self.state[p] = {...}``
            recorded = _FirstValues()
            recorded.update(value)
            value = recorded
        super().__setitem__(param, value)


def _depends_on(node: torch.fx.Node, sources: set) -> bool:
    seen, todo = set(), [node]
    while todo:
        current = todo.pop()
        if current in sources:
            return True
        if current not in seen:
            seen.add(current)
            todo.extend(current.all_input_nodes)
    return False


def _first_values(gm: torch.fx.GraphModule, params: Sequence[torch.Tensor]) -> list:
    """Evaluate the recorded-state graph on the real parameters.

    The recorded values depend on the parameters at most (checked before): the gradient
    inputs are unused, the parameters stand in for them. On the ``tpu`` device the graph runs
    as one jitted program (op by op it cost ~3 s for W1's 39 parameters); parameters elsewhere
    (``meta`` models that are only lowered) run it as ordinary torch code.
    """
    if not all(isinstance(p, TpuTensor) for p in params):
        with torch.no_grad():
            return list(gm(*params, *params))
    index = params[0].device.index
    output = next(node for node in gm.graph.nodes if node.op == "output")
    dtypes = [node.meta["val"].dtype for node in output.args[0]]
    arrays = [p.jax_value() for p in params]
    results = jax.jit(lambda *a: interpreter.run_graph(gm, list(a) * 2)[0])(*arrays)
    return [wrap(r, dtype, index) for r, dtype in zip(results, dtypes)]


class TracedOptimizerAdapter(OptimizerAdapter):
    """Any ``torch.optim.Optimizer``: its own ``step()`` traced (module docstring).
    Host scalars per group: lr, step count before the update."""

    num_scalars = 2

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer)
        self._counters = StepCounters(optimizer)

    # -- host side ----------------------------------------------------------------------------

    def _live(self, group) -> list:
        return [p for p in group["params"] if p.requires_grad]

    def state_keys_for(self, group):
        self._initialise()
        state = self.optimizer.state
        key_sets = {tuple(k for k, v in state[p].items()
                          if k != STEP and isinstance(v, torch.Tensor))
                    for p in self._live(group)}
        if len(key_sets) > 1:
            raise UnsupportedOptimizerError(
                f"parameters of one param group hold different optimizer state {sorted(key_sets)}"
                "; the compiled step updates a group together")
        for p in self._live(group):
            for key, value in state[p].items():
                if value is not None and not isinstance(value, torch.Tensor):
                    raise UnsupportedOptimizerError(
                        f"{type(self.optimizer).__name__} keeps a {type(value).__name__} in its "
                        f"state under {key!r}; the compiled step carries state tensors only "
                        "(keep per-step values in tensors, as torch.optim does)")
        return key_sets.pop() if key_sets else ()

    def ensure_state(self, param, group):
        self._initialise()

    def static_settings(self, group):
        index = next(i for i, g in enumerate(self.optimizer.param_groups) if g is group)
        settings = [("param group", index), ("optimizer class", type(self.optimizer).__qualname__)]
        settings += [(key, _frozen(value)) for key, value in sorted(group.items())
                     if key not in ("params", "lr")]
        return tuple(settings)

    def host_scalars(self, group, step):
        return [_scalar(group["lr"]), float(step - 1)]

    def step_count(self, group):
        return self._counters.count(group)

    def set_step_count(self, group, step):
        self._counters.set(group, step)

    # -- traced side --------------------------------------------------------------------------

    def update(self, settings, params, grads, states, scalars):
        group = self.optimizer.param_groups[settings["param group"]]
        live = self._live(group)
        keys = self.state_keys_for(group)
        lr, steps_before = scalars[0], scalars[1]
        shadow_params, shadow_state = [], collections.defaultdict(dict)
        for param, grad, values, real in zip(params, grads, states, live):
            # Natural shapes (the program passes flat buffers): step() may read p.shape.
            # Clones, so that in-place updates do not write into the graph's inputs.
            p = param.reshape(real.shape).clone()
            p.grad = grad.reshape(real.shape)
            real_state = self.optimizer.state[real]
            state = {key: value.reshape(real_state[key].shape).clone()
                     for key, value in zip(keys, values)}
            if isinstance(real_state.get(STEP), torch.Tensor):
                state[STEP] = steps_before.to(real_state[STEP].dtype).reshape(
                    real_state[STEP].shape).clone()
            shadow_params.append(p)
            shadow_state[p] = state
        _run_step(self.optimizer, _shadow(self.optimizer, group, shadow_params, shadow_state, lr))
        new_params = [p.reshape(param.shape) for p, param in zip(shadow_params, params)]
        new_states = [[shadow_state[p][key].to(value.dtype).reshape(value.shape)
                       for key, value in zip(keys, values)]
                      for p, values in zip(shadow_params, states)]
        return new_params, new_states

    # -- state initialisation ---------------------------------------------------------------

    def _initialise(self) -> None:
        """Create missing state for every parameter, as the optimizer's first step would."""
        for group in self.optimizer.param_groups:
            fresh = [p for p in self._live(group) if not self.optimizer.state.get(p)]
            if fresh:
                self._initialise_group(group, fresh)

    def _initialise_group(self, group: dict, fresh: Sequence[torch.Tensor]) -> None:
        fakes = tracing.FakeFactory()
        n = len(fresh)
        layout: list[tuple[int, str]] = []  # (param index, key) of each recorded output

        def first_values(*flat):
            params = [p.clone() for p in flat[:n]]
            for p, g in zip(params, flat[n:]):
                p.grad = g
            state = _RecordingState()
            _run_step(self.optimizer, _shadow(self.optimizer, group, params, state,
                                              _scalar(group["lr"])))
            outputs = []
            layout.clear()
            for i, p in enumerate(params):
                recorded = state[p].first if p in state else {}
                for key in state.get(p, {}):
                    value = recorded.get(key)
                    if isinstance(value, torch.Tensor):
                        layout.append((i, key))
                        outputs.append(value)
                    elif value is not None:
                        raise UnsupportedOptimizerError(
                            f"{type(self.optimizer).__name__} keeps a {type(value).__name__} "
                            f"in its state under {key!r}; the compiled step carries state "
                            "tensors only (keep per-step values in tensors, as torch.optim "
                            "does)")
            return outputs

        # Distinct fakes for parameters and gradients (one object given twice would be one
        # graph input, and the gradient-dependence check could not tell them apart).
        fake_inputs = [fakes.like(p.shape, p.dtype, p.device) for _ in range(2) for p in fresh]
        with fakes.mode, torch.autocast("tpu", enabled=False):
            gm = tracing._trace(first_values, fake_inputs)
        self._check_gradient_free(gm, n, layout)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        values = _first_values(gm, fresh)
        on_device = bool(group.get("capturable") or group.get("fused"))
        for (i, key), value in zip(layout, values):
            if key == STEP and not on_device and value.device.type == "tpu":
                value = to_host(value)  # where torch keeps a non-capturable step counter
            self.optimizer.state[fresh[i]][key] = value

    def _check_gradient_free(self, gm: torch.fx.GraphModule, n: int, layout) -> None:
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
        grads = set(placeholders[n:])
        output = next(node for node in gm.graph.nodes if node.op == "output")
        for (i, key), node in zip(layout, output.args[0]):
            if isinstance(node, torch.fx.Node) and _depends_on(node, grads):
                raise UnsupportedOptimizerError(
                    f"{type(self.optimizer).__name__} creates its state {key!r} from the first "
                    "gradient; the compiled step creates state before the first update, so "
                    "initialise it from the parameter (e.g. torch.zeros_like(p)) in step()")

