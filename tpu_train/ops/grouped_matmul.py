"""The grouped matmul of a mixture of experts, and its lowering to ``jax.lax.ragged_dot``.

``tpu_train_ops::grouped_mm(x [m, k], w [groups, k, n], group_sizes [groups]) -> [m, n]``
multiplies consecutive row blocks of ``x`` by one matrix each: rows
``sum(group_sizes[:g]) ... sum(group_sizes[:g + 1]) - 1`` by ``w[g]`` (rows past the last group
give zeros). A mixture-of-experts layer sorts its tokens by expert and computes every expert in
one such call, with no capacity limit and no padding (``tpu_train.models.mixtral.moe``).

PyTorch's own ``aten._grouped_mm`` cannot stand in: its shape checks (the meta kernel the
compiled step traces with) accept bfloat16 only. The op is defined here, beside its lowering,
with a CPU kernel (a loop over the groups) and a shape-only kernel for tracing. It has no
PyTorch backward: the compiled step traces the forward and JAX differentiates the lowering
(``ragged_dot``'s derivative is a ``ragged_dot`` for ``x`` and a grouped ``x^T dy`` for
``w``), within :func:`differentiated_by_jax`. Anywhere else a call whose inputs require grad
raises (PyTorch's default for an op without a backward would drop the gradient silently);
on the CPU the model calls a differentiable loop instead.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import torch

from tpu_train.ops.matmul import accumulator_dtype, lax_precision
from tpu_train.ops.registry import lowers

NAMESPACE = "tpu_train_ops"

_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
_LIBRARY.define("grouped_mm(Tensor x, Tensor w, Tensor group_sizes) -> Tensor")


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor,
                         group_sizes: torch.Tensor) -> torch.Tensor:
    """The op on CPU tensors: one ``mm`` per group (differentiable by PyTorch's autograd)."""
    pieces, start = [], 0
    for group, size in enumerate(group_sizes.tolist()):
        pieces.append(x[start:start + size] @ w[group])
        start += size
    rest = x.shape[0] - start
    if rest:
        pieces.append(x.new_zeros(rest, w.shape[-1]))
    return torch.cat(pieces) if pieces else x.new_zeros(0, w.shape[-1])


_LIBRARY.impl("grouped_mm", grouped_mm_reference, "CPU")


@torch.library.register_fake(f"{NAMESPACE}::grouped_mm")
def _(x, w, group_sizes):
    torch._check(x.dim() == 2 and w.dim() == 3 and group_sizes.dim() == 1,
                 lambda: "grouped_mm takes x [m, k], w [groups, k, n], group_sizes [groups]")
    torch._check(x.shape[1] == w.shape[1] and w.shape[0] == group_sizes.shape[0],
                 lambda: f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)} and "
                         f"group_sizes {tuple(group_sizes.shape)} do not fit")
    return x.new_empty(x.shape[0], w.shape[2])


GROUPED_MM = getattr(torch.ops, NAMESPACE).grouped_mm.default
_JAX_DIFFERENTIATES = [0]


@contextlib.contextmanager
def differentiated_by_jax():
    """Within the block, forward traces are differentiated by JAX (the compiled step's loss
    graph and layer bodies): ``grouped_mm`` may then take inputs that require grad."""
    _JAX_DIFFERENTIATES[0] += 1
    try:
        yield
    finally:
        _JAX_DIFFERENTIATES[0] -= 1


def _autograd(x, w, group_sizes):
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad) \
            and not _JAX_DIFFERENTIATES[0]:
        raise RuntimeError(
            f"{NAMESPACE}::grouped_mm has no PyTorch backward: the grouped expert form trains "
            "in a compiled step that JAX differentiates (not with PyTorch's backward, "
            "trainer.remat=full, or eager on the tpu device); use moe_impl='dense' there")
    with torch._C._AutoDispatchBelowAutograd():
        return GROUPED_MM(x, w, group_sizes)


_LIBRARY.impl("grouped_mm", _autograd, "Autograd")


@lowers(GROUPED_MM)
def grouped_mm(x, w, group_sizes):
    out = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), precision=lax_precision(),
                             preferred_element_type=accumulator_dtype(x, w))
    return out.astype(jnp.result_type(x, w))
