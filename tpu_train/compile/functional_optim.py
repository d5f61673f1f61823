"""``torch.optim`` optimizers as pure update functions written in torch ops, for tracing.

The compiled step reads the user's optimizer (its ``param_groups`` hyper-parameters and its
``state``) and re-expresses one ``optimizer.step()`` as a function
``(params, grads, states, scalars) -> (new_params, new_states)`` that ``make_fx`` traces.

Per-step scalars that depend on the step count or the learning rate (Adam's bias corrections,
``1 - lr * weight_decay``, SGD's first-step momentum switch) are computed **once per step on the
host**, in double precision exactly as ``torch.optim``'s non-capturable path does, and fed to
the program as one small ``float32`` array. So the learning rate and the step count never
recompile, and the program has no per-parameter scalar ``pow``/``sqrt`` work (torch's
capturable path computes those per tensor on the device, which shows up as many tiny fusions).
Constant hyper-parameters (betas, eps, weight decay, momentum...) are baked into the program:
changing one recompiles, and the recompilation log names it.

Hand-written here (the fast path): ``Adam``, ``AdamW`` (incl. ``amsgrad``, ``maximize``,
coupled or decoupled weight decay) and ``SGD`` (momentum, dampening, nesterov, weight decay,
maximize). Torch semantics are kept where they are observable: Adam's ``step`` counters live in
``optimizer.state`` as in eager mode, SGD's momentum buffer equals the gradient on the first
step. Every other optimizer (and a subclass of these that overrides ``step``) gets
:class:`tpu_train.compile.traced_optim.TracedOptimizerAdapter`, which traces the optimizer's own
``step()``; docs/compile.md has the measurements behind keeping both.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import operator
from typing import Sequence

import numpy
import torch

from tpu_train.compile import stored_moments
from tpu_train.device.tensor import storage_of

__all__ = ["OptimizerAdapter", "adapter_for", "UnsupportedOptimizerError"]


class UnsupportedOptimizerError(NotImplementedError):
    pass


def _scalar(value) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


class StepCounters:
    """The ``state[p]["step"]`` counters of an optimizer, read and advanced from the host.

    torch keeps one counter per parameter (on the CPU, or on the device with ``capturable`` /
    ``fused``); the compiled step updates a param group together, so a group's counters must
    agree, and the host feeds the count to the program instead of the program reading them.

    A compiled step reads and advances every counter once per call. For CPU counters that
    goes through NumPy views of their memory, by C loops (``map``), after checking by identity
    that the group's parameters, ``optimizer.state`` and the counters are those of the last
    call (never looking a tensor up in a dict: ``Tensor.__hash__`` runs in Python): ~0.1 us a
    counter, where ``item()`` and ``fill_`` cost 5-10 us.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._device_steps: dict[int, tuple] = {}
        # Per param group (by id): _GroupCounters of the last look.
        self._groups: dict[int, _GroupCounters] = {}
        self._checked: dict[int, _GroupCounters] = {}

    def _read(self, step_t: torch.Tensor) -> int:
        # A counter on the device (capturable/fused) would cost a host sync per parameter per
        # step: trust the value written here last while the buffer is still the one written
        # (anything else — a loaded state dict, an eager step — is read once).
        if step_t.device.type != "cpu":
            known = self._device_steps.get(id(step_t))
            if known is not None and known[0] is storage_of(step_t).buffer:
                return known[1]
        return int(_scalar(step_t))

    def _group_counters(self, group) -> "_GroupCounters":
        """The group's counters (and NumPy views of the CPU ones), looked up again only when
        the group's parameters, ``optimizer.state`` or a counter object changed (a loaded
        state dict replaces them)."""
        cached = self._groups.get(id(group))
        if cached is not None and cached.still(self.optimizer.state, group["params"]):
            return cached
        cached = self._groups[id(group)] = _GroupCounters.look_up(self.optimizer.state,
                                                                  group["params"])
        return cached

    def count(self, group) -> int:
        """Updates applied so far to the group (0 without counters)."""
        counters = self._group_counters(group)
        self._checked[id(group)] = counters  # for the set() that follows
        if counters.all_views:
            counts = set(map(_ITEM, counters.views))
        else:
            counts = {v.item() if v is not None else self._read(t)
                      for t, v in zip(counters.tensors, counters.views)}
        if len(counts) > 1:
            raise UnsupportedOptimizerError(
                f"parameters of one param group are at different step counts "
                f"{sorted(int(c) for c in counts)}; the compiled step updates a group together")
        return int(counts.pop()) if counts else 0

    def set(self, group, step: int) -> None:
        """Record the new step count in ``optimizer.state`` (where eager torch keeps it)."""
        value = float(step)
        # A step reads the counts (count) just before the program runs and sets them right
        # after: nothing can have replaced the counters in between.
        counters = self._checked.pop(id(group), None) or self._group_counters(group)
        if counters.all_views:  # the CPU tensors' own memory
            collections.deque(map(_FILL, counters.views, itertools.repeat(value)), maxlen=0)
            return
        shared_device_value = None
        for step_t, view in zip(counters.tensors, counters.views):
            if view is not None:
                view.fill(value)
            elif step_t.device.type == "cpu":
                step_t.fill_(value)
            else:
                # A device-resident counter (capturable/fused): swap in a new buffer, shared by
                # the group (JAX arrays are immutable, so sharing is safe).
                if shared_device_value is None:
                    shared_device_value = torch.tensor(value, dtype=step_t.dtype).to(step_t.device)
                buffer = storage_of(shared_device_value).buffer
                storage_of(step_t).buffer = buffer
                self._device_steps[id(step_t)] = (buffer, int(step))


_ITEM = numpy.ndarray.item
_FILL = numpy.ndarray.fill
_GET_STEP = operator.methodcaller("get", "step")


@dataclasses.dataclass
class _GroupCounters:
    """One param group's step counters as last looked up (:class:`StepCounters`)."""

    state: dict  # optimizer.state then, with its keys and values (per-parameter dicts)
    state_keys: list
    state_values: list
    params: list  # the group's parameters then
    holders: list  # the state dicts of those parameters that have state
    steps: list  # holder.get("step") for each (a counter, or whatever else it holds)
    tensors: list  # the counters (the tensors among ``steps``)
    views: list  # per counter: a NumPy view of a one-element CPU counter, else None
    all_views: bool

    @classmethod
    def look_up(cls, state, params) -> "_GroupCounters":
        holders = [state[p] for p in params if p in state]
        steps = list(map(_GET_STEP, holders))
        tensors = [t for t in steps if isinstance(t, torch.Tensor)]
        views = [t.detach().numpy() if t.device.type == "cpu" and t.numel() == 1 else None
                 for t in tensors]
        return cls(state, list(state.keys()), list(state.values()), list(params), holders,
                   steps, tensors, views, all(v is not None for v in views))

    def still(self, state, params) -> bool:
        """Is this what a new look-up would find? (Identity checks run by C loops.)"""
        return (state is self.state and len(state) == len(self.state_keys)
                and len(params) == len(self.params)
                and all(map(operator.is_, params, self.params))
                and all(map(operator.is_, state.keys(), self.state_keys))
                and all(map(operator.is_, state.values(), self.state_values))
                and all(map(operator.is_, map(_GET_STEP, self.holders), self.steps)))


class OptimizerAdapter:
    """How one optimizer class maps to a traced update (subclasses per family)."""

    #: names of the per-parameter device state tensors, in program order
    state_keys: tuple[str, ...] = ()
    #: number of host scalars per parameter group (column 0 is always the lr)
    num_scalars: int = 1
    #: True when :meth:`update` of one parameter reads nothing of the others: the update is
    #: then traced once per distinct parameter signature (:mod:`.update_templates`)
    per_parameter: bool = False

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    # -- host side ----------------------------------------------------------------------------

    def state_keys_for(self, group: dict) -> tuple[str, ...]:
        return self.state_keys

    def static_settings(self, group: dict) -> tuple:
        """Hyper-parameters baked into the program, as ``(name, value)`` pairs."""
        raise NotImplementedError

    def ensure_state(self, param: torch.Tensor, group: dict) -> None:
        """Create ``optimizer.state[param]`` as ``torch.optim`` would on its first step."""

    def host_scalars(self, group: dict, step: int) -> list[float]:
        """The per-group scalars for the update that makes ``step`` the new step count."""
        raise NotImplementedError

    def step_count(self, group: dict) -> int:
        """Updates applied so far to the group (0 for fresh state)."""
        return 0

    def set_step_count(self, group: dict, step: int) -> None:
        """Record the new step count in ``optimizer.state`` (where eager torch keeps it)."""

    # -- traced side --------------------------------------------------------------------------

    def update(self, settings: dict, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               states: Sequence[Sequence[torch.Tensor]], scalars: torch.Tensor):
        """One update of a group in torch ops. ``states[i]`` holds param i's state tensors in
        ``state_keys`` order; ``scalars`` is the group's row of host scalars (0-dim slices keep
        low-precision parameters in their dtype, as Python floats do in eager torch)."""
        raise NotImplementedError


class AdamAdapter(OptimizerAdapter):
    """``torch.optim.Adam`` / ``AdamW``; scalars: lr, 1 - lr*wd, -lr/bc1, sqrt(bc2)."""

    num_scalars = 4
    per_parameter = True

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._counters = StepCounters(optimizer)
        # Moments stored in this dtype, the update computed in float32
        # (:mod:`.stored_moments`); None: torch's own, moments in the parameter's dtype.
        self.state_dtype = getattr(optimizer, "state_dtype", None)

    def state_keys_for(self, group):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _decoupled(self, group) -> bool:
        if "decoupled_weight_decay" in group:
            return bool(group["decoupled_weight_decay"])
        return isinstance(self.optimizer, torch.optim.AdamW)

    def static_settings(self, group):
        beta1, beta2 = (_scalar(b) for b in group["betas"])
        return (("betas", (beta1, beta2)), ("eps", _scalar(group["eps"])),
                ("weight_decay", _scalar(group["weight_decay"])),
                ("amsgrad", bool(group["amsgrad"])), ("maximize", bool(group["maximize"])),
                ("decoupled_weight_decay", self._decoupled(group))) + (
                    (("state_dtype", str(self.state_dtype)),) if self.state_dtype else ())

    def ensure_state(self, param, group):
        state = self.optimizer.state[param]
        if state:
            return
        on_device = group.get("capturable") or group.get("fused")
        # Built on the CPU and moved: torch.tensor(..., device="tpu") is not supported by the
        # device layer (it reaches aten::_copy_from).
        step = torch.tensor(0.0, dtype=torch.float32)
        state["step"] = step.to(param.device) if on_device else step
        for key in self.state_keys_for(group):
            state[key] = torch.zeros_like(param, dtype=self.state_dtype,
                                          memory_format=torch.preserve_format)

    def step_count(self, group):
        return self._counters.count(group)

    def set_step_count(self, group, step):
        self._counters.set(group, step)

    def host_scalars(self, group, step):
        lr = _scalar(group["lr"])
        beta1, beta2 = (_scalar(b) for b in group["betas"])
        wd = _scalar(group["weight_decay"])
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        return [lr, 1 - lr * wd, -lr / bias_correction1, math.sqrt(bias_correction2)]

    def update(self, settings, params, grads, states, scalars):
        beta1, beta2 = settings["betas"]
        eps, wd = settings["eps"], settings["weight_decay"]
        decay, neg_step_size, bias_correction2_sqrt = scalars[1], scalars[2], scalars[3]
        stored = settings.get("state_dtype")
        new_params, new_states = [], []
        for param, grad, state in zip(params, grads, states):
            if stored:  # float32 arithmetic on moments stored narrower (:mod:`.stored_moments`)
                param_dtype, state_dtype = param.dtype, state[0].dtype
                param, grad = param.float(), grad.float()
                state = [s.float() for s in state]
            exp_avg, exp_avg_sq = state[0], state[1]
            if settings["maximize"]:
                grad = -grad
            if wd != 0:
                if settings["decoupled_weight_decay"]:
                    param = param * decay
                else:
                    grad = grad.add(param, alpha=wd)
            exp_avg = exp_avg.lerp(grad, 1 - beta1)
            exp_avg_sq = exp_avg_sq.mul(beta2).addcmul(grad, grad, value=1 - beta2)
            if settings["amsgrad"]:
                max_exp_avg_sq = torch.maximum(state[2], exp_avg_sq)
                denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add(eps)
                new_states.append([exp_avg, exp_avg_sq, max_exp_avg_sq])
            else:
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add(eps)
                new_states.append([exp_avg, exp_avg_sq])
            new_params.append(param + (exp_avg / denom) * neg_step_size)
            if stored:
                new_params[-1] = new_params[-1].to(param_dtype)
                new_states[-1] = [s.to(state_dtype) for s in new_states[-1]]
        return new_params, new_states


class SGDAdapter(OptimizerAdapter):
    """``torch.optim.SGD``; scalars: lr, momentum this step, gradient weight this step.

    torch's momentum buffer starts as a copy of the first gradient and then follows
    ``buf = momentum * buf + (1 - dampening) * grad``. With the buffer created as zeros, the
    host feeds ``(0, 1)`` on the first step and ``(momentum, 1 - dampening)`` afterwards: the
    same values from one program.
    """

    num_scalars = 3
    per_parameter = True

    def state_keys_for(self, group):
        return ("momentum_buffer",) if _scalar(group["momentum"]) != 0 else ()

    def static_settings(self, group):
        return (("momentum", _scalar(group["momentum"])),
                ("dampening", _scalar(group["dampening"])),
                ("weight_decay", _scalar(group["weight_decay"])),
                ("nesterov", bool(group["nesterov"])), ("maximize", bool(group["maximize"])))

    def ensure_state(self, param, group):
        if _scalar(group["momentum"]) == 0:
            return
        state = self.optimizer.state[param]
        if state.get("momentum_buffer") is None:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            # Marks a buffer the first compiled update will overwrite with the gradient.
            self._fresh.add(param)

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._fresh: set = set()

    def step_count(self, group):
        fresh = [p in self._fresh for p in group["params"]]
        if any(fresh) and not all(fresh):
            raise UnsupportedOptimizerError(
                "some parameters of an SGD param group have a momentum buffer and some do not; "
                "the compiled step updates a group together")
        return 0 if (fresh and fresh[0]) else 1

    def set_step_count(self, group, step):
        if step == 0:  # back before the first update (a skipped one): the buffers are fresh
            state = self.optimizer.state
            self._fresh.update(p for p in group["params"]
                               if state.get(p, {}).get("momentum_buffer") is not None)
            return
        for p in group["params"]:
            self._fresh.discard(p)

    def host_scalars(self, group, step):
        lr = _scalar(group["lr"])
        momentum, dampening = _scalar(group["momentum"]), _scalar(group["dampening"])
        if step <= 1:
            return [lr, 0.0, 1.0]
        return [lr, momentum, 1 - dampening]

    def update(self, settings, params, grads, states, scalars):
        lr, momentum_now, grad_weight = scalars[0], scalars[1], scalars[2]
        new_params, new_states = [], []
        for param, grad, state in zip(params, grads, states):
            if settings["maximize"]:
                grad = -grad
            if settings["weight_decay"] != 0:
                grad = grad.add(param, alpha=settings["weight_decay"])
            if settings["momentum"] != 0:
                buf = state[0] * momentum_now + grad * grad_weight
                new_states.append([buf])
                grad = grad.add(buf, alpha=settings["momentum"]) if settings["nesterov"] else buf
            else:
                new_states.append([])
            new_params.append(param - grad * lr)
        return new_params, new_states


# torch.optim optimizers whose step() a compiled step cannot trace (reasons in adapter_for).
_NOT_TRACEABLE = (torch.optim.LBFGS, torch.optim.SparseAdam)


def unhooked(step):
    """``step`` without the wrapper ``Optimizer.__init__`` puts around a class's ``step``.

    ``Optimizer._patch_step_function`` wraps the ``step`` it finds on the instance's class once
    (``profile_hook_step``: step hooks and a profiler range; marked ``hooked``, made with
    ``functools.wraps``) — on whichever class is instantiated first, so a subclass that
    inherits ``step`` may hold its own wrapper of the parent's function. There is no public
    way to reach the function under it, so this one place unwraps that layer (only that
    layer: the class's own decorators, e.g. ``@torch.no_grad()``, stay).
    """
    while getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


def adapter_for(optimizer: torch.optim.Optimizer) -> OptimizerAdapter:
    """The hand-written adapter for ``Adam``/``AdamW``/``SGD`` (a subclass that overrides
    ``step`` is not one of them), else the traced ``step()`` of any other optimizer."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"compile_train_step needs a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if isinstance(optimizer, _NOT_TRACEABLE):
        raise UnsupportedOptimizerError(
            f"compile_train_step cannot run {type(optimizer).__name__}: LBFGS re-evaluates the "
            "loss through a closure inside step() and SparseAdam needs sparse gradients. Use "
            "the eager step for it.")
    step = unhooked(type(optimizer).step)
    if step in (unhooked(torch.optim.Adam.step), unhooked(torch.optim.AdamW.step),
                unhooked(stored_moments.AdamStoredMoments.step)):
        return AdamAdapter(optimizer)
    if step is unhooked(torch.optim.SGD.step):
        return SGDAdapter(optimizer)
    from tpu_train.compile.traced_optim import TracedOptimizerAdapter  # it imports this module

    return TracedOptimizerAdapter(optimizer)
