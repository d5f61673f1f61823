"""The loss graph: the step's forward traced alone, for JAX to differentiate.

Tracing PyTorch's backward (:func:`tracing.trace_grad_graph`, ``torch.func.grad`` under
``make_fx``) costs about three times the forward's trace: the backward adds twice the forward's
nodes, every one dispatched through fake tensors and recorded in Python (a 4-layer dim-512
Llama: 1,166 nodes in 1.3-1.6 s, against 467 in 0.26 s for the forward alone). JAX
differentiates the lowered forward in a fraction of that, so where the forward graph carries
all that PyTorch's autograd would do with it, the step traces only the forward
(:func:`trace_loss_graph`) and the program takes ``jax.grad`` of it.

What a forward graph cannot carry is autograd's own behaviour: a ``detach()`` / ``.data`` /
``torch.no_grad()`` on a value that depends on the parameters (the graph records the values,
not that their gradient is cut), tensor hooks, and custom ``autograd.Function`` s and other
higher-order operators (checkpointed regions among them), whose backward is their own. The
forward runs under ``torch.func.vjp`` (so that ``requires_grad`` answers as in training,
without tracing a backward) and :class:`_AutogradProbe` watches the user's calls: the first
such feature ends the trace with :class:`TorchAutogradNeeded`, and the caller traces PyTorch's
backward instead. Scanned layer stacks keep their own differentiation
(:mod:`.layer_scan`) and are not traced here.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from tpu_train.compile import shared_layers, tracing
from tpu_train.ops.grouped_matmul import differentiated_by_jax

AUTODIFF_CHOICES = ("jax", "torch")
# autograd.Functions whose forward lowers to JAX functions that JAX differentiates as their
# backward would (a ``custom_vjp``): the loss graph records their forward and keeps going.
# Each also needs its forward to run under functionalize
# (``remat_regions.FORWARD_UNDER_FUNCTIONALIZE``).
DIFFERENTIATED_BY_JAX: set = set()


class TorchAutogradNeeded(Exception):
    """The forward uses an autograd feature a forward graph does not carry (``reason``)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _differentiable(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _cutting_feature(func, args, kwargs) -> str | None:
    """What autograd-only behaviour this call has, if any."""
    if isinstance(func, torch._ops.HigherOrderOperator):  # autograd.Function, checkpoint
        if args and isinstance(args[0], type) and args[0] in DIFFERENTIATED_BY_JAX:
            return None
        return f"{getattr(func, '__name__', func)} (a custom autograd.Function or checkpoint)"
    if func in (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
                torch.Tensor.retain_grad):
        return f"Tensor.{func.__name__}"
    detaches = func in (torch.Tensor.detach, torch.Tensor.detach_, torch.detach) \
        or getattr(func, "__self__", None) is torch.Tensor.data
    if detaches and args and _differentiable(args[0]):
        return "detach() / .data of a value that depends on the parameters"
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        if any(_differentiable(a) for a in tree_flatten((args, kwargs))[0]):
            return f"{getattr(func, '__name__', func)} under torch.no_grad() on a value " \
                   "that depends on the parameters"
    return None


class _AutogradProbe(TorchFunctionMode):
    """Raises :class:`TorchAutogradNeeded` at the first call whose gradient behaviour a
    forward graph would lose (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _cutting_feature(func, args, kwargs)
        if reason is not None:
            # A property read whose value holds no tensor (x.device, x.shape, x.dtype) cuts no
            # gradient, under torch.no_grad() or not: the rotary embeddings of transformers
            # 5.17 (for one) run under @torch.no_grad() and read the hidden states' x.device.
            if getattr(func, "__name__", None) == "__get__":
                result = func(*args, **kwargs)
                if not any(isinstance(v, torch.Tensor) for v in tree_flatten(result)[0]):
                    return result
            raise TorchAutogradNeeded(reason)
        return func(*args, **kwargs)


def _probed(run: Callable, requires: Sequence[bool]) -> Callable:
    """``run`` traced as the loss graph's forward is: under the probe, and under
    ``torch.func.vjp`` of the arguments that require grad (``requires``)."""
    wanted = [i for i, r in enumerate(requires) if r]

    def probed(*flat):
        def of(differentiated):
            full = list(flat)
            for i, value in zip(wanted, differentiated):
                full[i] = value
            with _AutogradProbe(), differentiated_by_jax():
                return run(*full)

        if not wanted:
            return of([])
        outputs, _ = torch.func.vjp(of, [flat[i] for i in wanted])
        return outputs

    return probed


def trace_loss_graph(model: torch.nn.Module, loss_fn: Callable, diff_names: Sequence[str],
                     const_names: Sequence[str], batch_spec, fakes: tracing.FakeFactory,
                     diff_fakes: list, const_fakes: list, batch_fakes: list):
    """The loss graph and whether the loss is weighted (raises :class:`TorchAutogradNeeded`).

    Placeholders as :func:`tracing.trace_grad_graph`'s (``diff + consts + batch``); it returns
    ``[loss, weight]``: the loss in its own dtype (what is differentiated) and the weight as
    float32 (see ``trace_grad_graph`` for ``(loss_sum, count)`` losses). Repeated layers are
    traced once and called per layer (:mod:`.shared_layers`).
    """
    n_diff, n_const = len(diff_fakes), len(const_fakes)
    loss_of, weighted, wrapper = tracing.loss_closure(model, loss_fn, diff_names, const_names)

    def loss_step(*flat):
        diff = list(flat[:n_diff])
        const = list(flat[n_diff:n_diff + n_const])
        batch = tree_unflatten(list(flat[n_diff + n_const:]), batch_spec)

        def probed(diff_values):
            with _AutogradProbe(), differentiated_by_jax():
                return loss_of(diff_values, const, batch)

        loss, _, weight = torch.func.vjp(probed, diff, has_aux=True)
        return [loss, weight]

    def trace():
        with fakes.mode, tracing.traced_checkpoints(wrapper):
            return tracing.trace_forward(loss_step, diff_fakes + const_fakes + batch_fakes)

    gm = shared_layers.traced_with_shared_layers(model, trace, _probed)
    return gm, weighted[-1]


def gathered_parameters(gm: torch.fx.GraphModule, n_params: int) -> frozenset:
    """Positions among the graph's first ``n_params`` inputs that only ``aten.embedding``
    reads, as its table: under a compute dtype these enter in their own dtype, and the
    interpreter casts the gathered rows to the node's dtype (as a JAX user gathers, then
    casts). Cast whole at the top, a float32 vocabulary table was converted to bf16 in full
    every step (W1: 16.8 MB read, 8.4 MB written, for 1024 rows), and its gradient summed
    duplicate tokens' rows in bf16; now in float32, as PyTorch's own embedding backward."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][:n_params]
    return frozenset(
        i for i, node in enumerate(placeholders)
        if node.users and all(user.op == "call_function"
                              and user.target is torch.ops.aten.embedding.default
                              and user.args[0] is node and node not in user.args[1:]
                              for user in node.users))
