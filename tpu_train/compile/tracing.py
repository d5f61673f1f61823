"""Trace the pieces of a training step into functional, decomposed aten FX graphs.

Two graphs make one step:

* the **gradient graph** ``(params, constants, batch) -> (grads, loss, weight)``: the user's
  ``loss_fn(model, batch)`` under ``torch.func.grad_and_value`` with the module's tensors
  swapped for graph inputs by ``torch.func.functional_call``. By default the step traces only
  the forward of the same call instead (:mod:`.loss_graph`) and JAX differentiates it; this
  graph is traced where the forward uses autograd itself;
* the **update graph** ``(params, grads, states, scalars) -> (new params, new states,
  grad norm)``: global-norm clipping and the optimizer update (:mod:`.functional_optim`).

They are separate so that gradient accumulation can loop over the gradient graph inside the
program (``lax.scan``) while the optimizer runs once; XLA still sees one program.

Tracing runs ``make_fx(functionalize(fn, remove="mutations"))`` under a ``FakeTensorMode``
whose fake tensors carry the real ``tpu`` device, so device-dependent model code (factories
with ``device=x.device``) traces as it runs. Nothing touches device memory during tracing.

Inside that trace :func:`torch.compiler.is_compiling` answers True (:func:`compile_session`):
library code that skips host-side value checks when compiled (transformers' attention-mask
utilities call ``.all()`` on the mask otherwise) must take its traceable branch here too.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_unflatten

from tpu_train.compile.remat_regions import traced_checkpoints
from tpu_train.ops import registry

# Decompositions are skipped for ops the lowering table covers directly: a lowered
# ``native_layer_norm_backward`` or ``addmm`` is one node (and one XLA-friendly expression)
# where the decomposition would be several.
_KEEP_DECOMPOSED: frozenset = frozenset()


def decomposition_table() -> dict:
    """``core_aten_decompositions()`` minus the ops that have a lowering of their own.

    Rebuilt only when lowerings were registered since (building it takes 60-85 ms here,
    twice per compiled step)."""
    return dict(_decomposition_table(registry.lowering_count()))  # callers may edit theirs


@functools.lru_cache(maxsize=4)
def _decomposition_table(lowering_count: int) -> dict:
    import torch._decomp

    # ``core_aten_decompositions()`` is this table plus an entry per CompositeImplicitAutograd
    # op, which a make_fx trace decomposes by itself (the same graphs and programs here, W1 and
    # five transformers models); collecting those ops looks up every aten operator in the C++
    # dispatcher, 0.2 s of every process's first compile.
    core = getattr(torch._decomp, "_core_aten_decompositions_post_autograd", None)
    table = core() if core is not None else torch._decomp.core_aten_decompositions()
    return {op: fn for op, fn in table.items()
            if op in _KEEP_DECOMPOSED or registry.get_lowering(op) is None}


class _TraceFakeMode(FakeTensorMode):
    """A ``FakeTensorMode`` that never makes a real ``tpu`` tensor while tracing.

    ``torch.tensor(data, device="tpu")`` builds its value with the dispatch modes off and only
    then lifts it into them; transformers' KV cache does that (``torch.tensor([],
    device=...)``) in every forward. With an accelerator present FakeTensorMode lets the
    value be made on the device and constant-folds moves onto it, which here would create a
    real ``TpuTensor`` (not fake: the trace then fails mixing the two). ``avoid_device_init``
    is FakeTensorMode's own switch for "do not touch the device": the value is made on the
    CPU, lifted, and moved to ``tpu`` with the modes on (a fake ``_to_copy`` of a graph
    constant), and device moves of constants are not folded. FakeTensorMode turns it on by
    itself when no accelerator is available; a trace never needs the device, so always.
    """

    @property
    def avoid_device_init(self) -> bool:
        return True


class FakeFactory:
    """Makes fake tensors with given shapes, dtypes and devices in one ``FakeTensorMode``."""

    def __init__(self):
        self.mode = _TraceFakeMode(allow_non_fake_inputs=False)

    def like(self, shape, dtype: torch.dtype, device: torch.device) -> FakeTensor:
        meta = torch.empty(tuple(shape), dtype=dtype, device="meta")
        return FakeTensor(self.mode, meta, torch.device(device))


@contextlib.contextmanager
def compile_session():
    """Make ``torch.compiler.is_compiling()`` True for the duration of our trace.

    Model code asks "am I being traced?" to skip data-dependent host checks (transformers'
    ``is_tracing``: ``torch.compiler.is_compiling()``, ``torch.jit.is_tracing()``, an fx
    ``Proxy`` or ``FakeTensor`` argument). A make_fx trace under functionalize and
    ``torch.func.grad`` is none of those (the values are functional / grad wrappers around the
    fake tensors), so without this such code calls ``.item()`` on a fake value. The check is
    meant for exactly this case: torch itself holds the flag True around backends and make_fx
    traces that run inside a compile (dynamo's compile session) and around non-strict export's
    make_fx trace. There is no public setter: torch >= 2.13 has the context manager dynamo
    uses (``torch.compiler._compile_session_context``); 2.11 and 2.12 read the module flag
    ``torch.compiler._is_compiling_flag`` that export toggles. tests/compile/
    test_transformers_models.py fails if neither makes ``is_compiling()`` True.
    ``is_exporting()`` stays False: we are not exporting, and models pick export-only paths
    on it.
    """
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is not None:
        with session():
            yield
        return
    previous = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = previous


class FusedAttentionCalls(torch.overrides.TorchFunctionMode):
    """Trace ``F.scaled_dot_product_attention`` on ``tpu`` tensors as one fused-attention op.

    Eager ``tpu`` tensors reach PyTorch's fused op for custom devices
    (``_scaled_dot_product_fused_attention_overrideable``) through the device's
    ``_fused_sdp_choice``; the fake tensors of a trace report their device to Python only, so
    PyTorch's C++ dispatch of SDPA sees a meta tensor and decomposes attention into its math
    form (repeated K/V heads, a materialised mask, f32 scores kept for the backward). This mode
    sends the call to the fused op instead, whose lowering handles grouped-query heads and the
    causal mask itself and has a fused backward (``tpu_train.ops.attention``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            fused = _fused_attention(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                     scale=None, enable_gqa=False):
    """The fused op's output, or None where PyTorch's own path must decide (another device,
    head counts that only ``enable_gqa`` allows, a mask together with ``is_causal``)."""
    if not all(isinstance(t, torch.Tensor) and t.device.type == "tpu" and t.dim() == 4
               for t in (query, key, value)):
        return None
    heads, kv_heads = query.shape[1], key.shape[1]
    if value.shape[1] != kv_heads or heads % kv_heads or (heads != kv_heads and not enable_gqa):
        return None
    if attn_mask is not None and is_causal:
        return None  # torch rejects the pair; let it say so
    if torch.is_autocast_enabled("tpu"):
        # Autocast lists SDPA among the ops that run in the low-precision dtype; the fused op
        # called here directly has no autocast rule of its own.
        low = torch.get_autocast_dtype("tpu")
        query, key, value = (t.to(low) if t.is_floating_point() else t for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(low)
    return torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        query, key, value, attn_mask, dropout_p, is_causal, False, scale=scale)[0]


def _trace(fn: Callable, fake_args: Sequence) -> torch.fx.GraphModule:
    functional = torch.func.functionalize(fn, remove="mutations")
    with compile_session(), FusedAttentionCalls():
        return make_fx(functional, decomposition_table=decomposition_table(),
                       tracing_mode="real")(*fake_args)


trace_forward = _trace  # a forward-only graph (a scanned layer's body), same rules


class _LossModule(torch.nn.Module):
    """``loss_fn(model, batch)`` as a module, so ``functional_call`` can swap its tensors."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


def _check_loss(value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 0 \
            or (what == "loss" and not value.dtype.is_floating_point):
        raise TypeError(
            f"loss_fn(model, batch) must return a 0-dim floating-point loss tensor or a tuple "
            f"(loss_sum, count) of 0-dim tensors; its {what} is a {type(value).__name__}"
            + (f" of shape {tuple(value.shape)} and dtype {value.dtype}"
               if isinstance(value, torch.Tensor) else ""))
    return value


def loss_closure(model: torch.nn.Module, loss_fn: Callable, diff_names: Sequence[str],
                 const_names: Sequence[str]):
    """``loss_of(diff_values, const_values, batch) -> (loss, weight)`` with the module's tensors
    swapped for the given values, a list to which each call appends whether the loss is
    weighted, and the module ``loss_of`` calls (trace it under :func:`traced_checkpoints` of
    it). ``loss_fn`` returns either a loss (weight 1) or ``(loss_sum, count)``; the weight
    comes back as float32."""
    wrapper = _LossModule(model, loss_fn)
    diff_keys = ["model." + n for n in diff_names]
    const_keys = ["model." + n for n in const_names]
    weighted = []

    def loss_of(diff_values, const_values, batch):
        mapping = dict(zip(diff_keys, diff_values))
        mapping.update(zip(const_keys, const_values))
        result = torch.func.functional_call(wrapper, mapping, (batch,))
        if isinstance(result, (tuple, list)) and len(result) == 2:
            loss, weight = _check_loss(result[0], "loss"), _check_loss(result[1], "count")
            weighted.append(True)
            return loss, weight.to(torch.float32)
        loss = _check_loss(result, "loss")
        weighted.append(False)
        return loss, torch.ones((), dtype=torch.float32, device=loss.device)

    return loss_of, weighted, wrapper


def trace_grad_graph(model: torch.nn.Module, loss_fn: Callable, diff_names: Sequence[str],
                     const_names: Sequence[str], batch_spec, fakes: FakeFactory,
                     diff_fakes: list, const_fakes: list, batch_fakes: list):
    """The gradient graph and whether the loss is weighted.

    Its placeholders are ``diff_fakes + const_fakes + batch_fakes``; it returns
    ``[grads..., loss, weight]`` (loss and weight as float32). ``loss_fn`` returns either a
    loss (weight 1: micro-batches are averaged) or ``(loss_sum, count)``: then the gradients
    are of ``loss_sum`` and the step divides the sums over micro-batches by the total count,
    so that accumulation weighs every item (token) equally.
    """
    loss_of, weighted, wrapper = loss_closure(model, loss_fn, diff_names, const_names)
    n_diff, n_const = len(diff_fakes), len(const_fakes)

    def grad_step(*flat):
        diff = list(flat[:n_diff])
        const = list(flat[n_diff:n_diff + n_const])
        batch = tree_unflatten(list(flat[n_diff + n_const:]), batch_spec)

        # The constants are arguments of the transformed function (not captured from outside
        # it): a forward that overwrites a buffer (BatchNorm's running statistics) is then
        # allowed by torch.func, and functionalization records the write as a graph output.
        def differentiated(diff_values, const_values):
            loss, weight = loss_of(diff_values, const_values, batch)
            return loss, weight.detach()

        grads, (loss, weight) = torch.func.grad_and_value(differentiated, argnums=0,
                                                          has_aux=True)(diff, const)
        return list(grads) + [loss.detach().to(torch.float32), weight]

    with fakes.mode, traced_checkpoints(wrapper):
        gm = _trace(grad_step, diff_fakes + const_fakes + batch_fakes)
    return gm, weighted[-1]


def global_grad_norm(norms: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s total 2-norm from the per-tensor 2-norms."""
    return torch.linalg.vector_norm(torch.stack(list(norms)), 2)


def clip_coefficient(grad_norm: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6)), always multiplied."""
    return torch.clamp(max_grad_norm / (grad_norm + 1e-6), max=1.0)


def trace_update_graph(adapter, group_settings: Sequence[dict], group_sizes: Sequence[int],
                       state_counts: Sequence[int], max_grad_norm: float | None,
                       fakes: FakeFactory, param_fakes: list, grad_fakes: list,
                       state_fakes: list, scalars_fake) -> torch.fx.GraphModule:
    """The update graph; placeholders ``params + grads + states + [scalars]``, returns
    ``[new params..., new states..., grad_norm]``. ``states`` is flat: per parameter, its
    ``state_counts[i]`` tensors in the adapter's key order; ``scalars`` is ``[groups, k]``.

    An adapter whose update is ``per_parameter`` is traced once per distinct parameter
    signature (:mod:`.update_templates`): the graph then holds one node per signature."""
    from tpu_train.compile.update_templates import TemplatedUpdate  # it imports this module

    if getattr(adapter, "per_parameter", False):
        group_of = [g for g, size in enumerate(group_sizes) for _ in range(size)]
        templated = TemplatedUpdate(adapter, group_settings, fakes, param_fakes,
                                    _per_parameter(state_fakes, state_counts), group_of,
                                    scalars_fake, clip=max_grad_norm is not None)
        return templated.graph(fakes, param_fakes, grad_fakes, state_fakes, state_counts,
                               scalars_fake, max_grad_norm)
    n = len(param_fakes)

    def update_step(*flat):
        params = list(flat[:n])
        grads = list(flat[n:2 * n])
        flat_states = list(flat[2 * n:-1])
        scalars = flat[-1]
        grad_norm = global_grad_norm([torch.linalg.vector_norm(g, 2) for g in grads])
        if max_grad_norm is not None:
            coef = clip_coefficient(grad_norm, max_grad_norm)
            grads = [g * coef.to(g.dtype) for g in grads]
        states = _per_parameter(flat_states, state_counts)
        new_params, new_states, start = [], [], 0
        for g, (settings, size) in enumerate(zip(group_settings, group_sizes)):
            stop = start + size
            p, s = adapter.update(settings, params[start:stop], grads[start:stop],
                                  states[start:stop], scalars[g])
            new_params.extend(p)
            for per_param in s:
                new_states.extend(per_param)
            start = stop
        return new_params + new_states + [grad_norm]

    # Autocast applies to the loss only (see compile_train_step's autocast_dtype): the
    # clipping and optimizer arithmetic run in the parameters' own dtype, as eager code that
    # calls optimizer.step() outside its autocast region does.
    with fakes.mode, torch.autocast("tpu", enabled=False):
        return _trace(update_step, param_fakes + grad_fakes + state_fakes + [scalars_fake])


def _per_parameter(flat_states: Sequence, state_counts: Sequence[int]) -> list:
    """The flat state list split per parameter (``state_counts[i]`` tensors for parameter i)."""
    states, cursor = [], 0
    for count in state_counts:
        states.append(list(flat_states[cursor:cursor + count]))
        cursor += count
    return states
