"""The summed cross-entropy of a linear output layer, over chunks of tokens.

``linear_cross_entropy_sum(hidden, weight, target)`` is
``F.cross_entropy(F.linear(hidden, weight).float(), target, reduction="sum")`` without the
full logits: the tokens are taken in chunks of ``max_rows`` rows, each chunk's float32 logits
``[rows, vocab]`` computed, reduced to its loss and, in the same pass, to its gradients
(:mod:`tpu_train.ops.linear_cross_entropy`), then dropped. At 32,768 tokens over a 32,000
vocabulary the full float32 logits take 4.2 GB and their gradient as much again; a chunk
takes at most :data:`~tpu_train.ops.linear_cross_entropy.CHUNK_LOGITS_BYTES`.

Two ops carry it, each lowered to JAX and computed by PyTorch on the CPU (the same chunks):
``linear_cross_entropy_sum`` (the loss, where nothing is differentiated) and
``linear_cross_entropy_sum_and_grads`` (the loss and its gradients for ``hidden`` and
``weight``). :class:`LinearCrossEntropy` gives the latter PyTorch's autograd: its backward
scales the gradients by the loss's incoming gradient. Traced for a compiled step whose
forward JAX differentiates (:mod:`.loss_graph`), the op's lowering does the same for JAX.

Under autocast the operands are cast to its dtype, as ``F.linear`` would: the products run in
bf16 with float32 results, and the loss is float32 in every mode.
"""

from __future__ import annotations

import torch

from tpu_train.compile import loss_graph, remat_regions
from tpu_train.ops import linear_cross_entropy as chunked
from tpu_train.ops.registry import lowers

# trainer.loss_chunk_tokens: rows per chunk for every call that names none (None: from the
# vocabulary, chunk_rows_for). Process-wide, as the matmul precision.
_CHUNK_TOKENS: list = [None]


def set_chunk_tokens(tokens: int | None) -> None:
    """Tokens per chunk of :func:`linear_cross_entropy_sum` where a call names none (None: as
    many as keep one chunk's float32 logits within ``CHUNK_LOGITS_BYTES``)."""
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                               or tokens < 1):
        raise ValueError(f"the loss's chunk must be a number of tokens >= 1 (or None), "
                         f"got {tokens!r}")
    _CHUNK_TOKENS[0] = tokens


_LIBRARY = torch.library.Library(remat_regions.BARRIER_NAMESPACE, "FRAGMENT")
_LIBRARY.define("linear_cross_entropy_sum(Tensor x, Tensor w, Tensor target, int ignore_index, "
                "int max_rows) -> Tensor")
_LIBRARY.define("linear_cross_entropy_sum_and_grads(Tensor x, Tensor w, Tensor target, "
                "int ignore_index, int max_rows) -> (Tensor, Tensor, Tensor)")


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _computed(x, w, target, ignore_index: int, max_rows: int, grads: bool):
    """PyTorch's computation of the ops, chunk by chunk as the lowering's."""
    dtype = torch.promote_types(x.dtype, w.dtype)
    acc = _accumulator(dtype)
    w_acc = w.to(dtype).to(acc)
    total = torch.zeros((), dtype=acc, device=x.device)
    grad_x = torch.empty_like(x) if grads else None
    grad_w = torch.zeros(w.shape, dtype=acc, device=x.device) if grads else None
    _, rows = chunked.chunk_layout(x.shape[0], max_rows)
    for start in range(0, x.shape[0], rows):
        x_chunk = x[start:start + rows].to(dtype).to(acc)
        t_chunk = target[start:start + rows]
        logits = x_chunk @ w_acc.T
        valid = t_chunk != ignore_index
        index = torch.where(valid, t_chunk, 0)
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, index[:, None])[:, 0]
        total = total + torch.where(valid, lse - picked, 0).sum()
        if grads:
            one_hot = torch.nn.functional.one_hot(index, logits.shape[-1]).to(acc)
            grad_logits = torch.where(valid[:, None], torch.exp(logits - lse[:, None]) - one_hot,
                                      0).to(dtype).to(acc)
            grad_x[start:start + rows] = (grad_logits @ w_acc).to(x.dtype)
            grad_w += grad_logits.T @ x_chunk
    if not grads:
        return total
    return total, grad_x, grad_w.to(w.dtype)


def _loss(x, w, target, ignore_index, max_rows):
    return _computed(x, w, target, ignore_index, max_rows, grads=False)


def _loss_and_grads(x, w, target, ignore_index, max_rows):
    return _computed(x, w, target, ignore_index, max_rows, grads=True)


_LIBRARY.impl("linear_cross_entropy_sum", _loss, "CompositeExplicitAutograd")
_LIBRARY.impl("linear_cross_entropy_sum_and_grads", _loss_and_grads, "CompositeExplicitAutograd")


def _loss_meta(x, w):
    return torch.empty((), dtype=_accumulator(torch.promote_types(x.dtype, w.dtype)),
                       device=x.device)


@torch.library.register_fake(f"{remat_regions.BARRIER_NAMESPACE}::linear_cross_entropy_sum")
def _(x, w, target, ignore_index, max_rows):
    return _loss_meta(x, w)


@torch.library.register_fake(
    f"{remat_regions.BARRIER_NAMESPACE}::linear_cross_entropy_sum_and_grads")
def _(x, w, target, ignore_index, max_rows):
    return _loss_meta(x, w), torch.empty_like(x), torch.empty_like(w)


LOSS = torch.ops.tpu_train_compile.linear_cross_entropy_sum.default
LOSS_AND_GRADS = torch.ops.tpu_train_compile.linear_cross_entropy_sum_and_grads.default


@lowers(LOSS)
def _lower_loss(x, w, target, ignore_index, max_rows):
    return chunked.chunked_loss_sum(x, w, target, ignore_index, max_rows)


@lowers(LOSS_AND_GRADS)
def _lower_loss_and_grads(x, w, target, ignore_index, max_rows):
    return chunked.differentiable_loss_and_grads(x, w, target, ignore_index, max_rows)


class LinearCrossEntropy(torch.autograd.Function):
    """The summed loss, differentiable for ``x`` and ``w`` (gradients from the forward pass)."""

    @staticmethod
    def forward(x, w, target, ignore_index: int, max_rows: int):
        return LOSS_AND_GRADS(x, w, target, ignore_index, max_rows)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, grad_x, grad_w = output
        ctx.mark_non_differentiable(grad_x, grad_w)
        ctx.save_for_backward(grad_x, grad_w)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grad_x, grad_w = ctx.saved_tensors
        return ((grad_loss * grad_x).to(grad_x.dtype), (grad_loss * grad_w).to(grad_w.dtype),
                None, None, None)


remat_regions.FORWARD_UNDER_FUNCTIONALIZE.add(LinearCrossEntropy)
loss_graph.DIFFERENTIATED_BY_JAX.add(LinearCrossEntropy)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                             *, ignore_index: int = -100,
                             max_rows: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).float(), target, ignore_index=ignore_index,
    reduction="sum")`` over chunks of at most ``max_rows`` tokens (default: those of
    :func:`set_chunk_tokens`, else as many as keep one chunk's float32 logits within
    :data:`~tpu_train.ops.linear_cross_entropy.CHUNK_LOGITS_BYTES`).

    ``hidden`` ``[..., dim]``, ``weight`` ``[vocab, dim]``, ``target`` of ``hidden``'s leading
    shape. Under autocast both operands are cast to its dtype first, as ``F.linear`` would."""
    if hidden.shape[:-1] != target.shape or weight.dim() != 2 \
            or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"linear_cross_entropy_sum needs hidden [..., dim], weight [vocab, dim] and target "
            f"[...]; got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, target "
            f"{tuple(target.shape)}")
    if max_rows is None:
        max_rows = _CHUNK_TOKENS[0] or chunked.chunk_rows_for(weight.shape[0])
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    x, t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(x, weight, t, ignore_index, max_rows)[0]
    return LOSS(x, weight, t, ignore_index, max_rows)
