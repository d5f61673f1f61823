"""The chunked ``F.linear_cross_entropy`` custom ops (``torch_nn::_linear_cross_entropy_*``).

``cross_entropy(input @ linear_weight.T + linear_bias, target)`` for class-index targets, with
class ``weight``, ``ignore_index`` and ``label_smoothing`` as ``F.cross_entropy`` defines them
(``mean`` divides both the NLL and the smoothing term by the summed weight of the targets that
count). PyTorch chunks the batch to bound the logits' memory; XLA sees the whole product at
once, so ``batch_chunk_size`` and the accumulation policy are accepted and not needed (the
logits are float32 for every input dtype).

The reducing op returns the loss and, computed in the same pass as the op's contract says,
the gradients of the loss for the inputs flagged ``compute_*_grad`` (empty ``(0, 0)`` /
``(0,)`` otherwise, as its fake kernel gives); its autograd formula scales them. The
``reduction='none'`` op returns the per-sample loss; its backward is PyTorch's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch.nn.modules.linear_cross_entropy  # noqa: F401  (defines the torch_nn ops)
from jax import lax

from tpu_train.ops.matmul import accumulator_dtype, lax_precision
from tpu_train.ops.registry import lowers
from torch import ops

_OPS = ops.torch_nn


def _losses(x, linear_weight, target, linear_bias, weight, ignore_index, label_smoothing):
    """``(per-sample loss, per-sample target weight)`` in float32."""
    logits = jnp.dot(x, linear_weight.T, precision=lax.Precision.HIGHEST)
    if linear_bias is not None:
        logits = logits + linear_bias
    logp = jax.nn.log_softmax(logits, axis=-1)
    valid = target != ignore_index
    index = jnp.where(valid, target, 0).astype(jnp.int32)
    class_weight = jnp.ones(logits.shape[-1], logp.dtype) if weight is None else weight
    target_weight = jnp.where(valid, class_weight[index], 0)
    nll = -target_weight * jnp.take_along_axis(logp, index[:, None], axis=1)[:, 0]
    smooth = -jnp.where(valid, jnp.sum(logp * class_weight, axis=-1), 0) / logits.shape[-1]
    loss = (1 - label_smoothing) * nll + label_smoothing * smooth
    return loss, target_weight


def _rows(input, target):
    return input.reshape(-1, input.shape[-1]).astype(jnp.float32), target.reshape(-1)


@lowers(_OPS._linear_cross_entropy_batch_chunked.default)
def linear_cross_entropy_batch_chunked(input, linear_weight, target, linear_bias, weight,
                                       reduction, ignore_index, label_smoothing,
                                       batch_chunk_size, acc_policy, acc_dtype,
                                       allow_retain_graph, compute_input_grad,
                                       compute_linear_weight_grad, compute_linear_bias_grad):
    """``(loss, grad_input, grad_linear_weight, grad_linear_bias)`` for ``mean``/``sum``."""
    x, t = _rows(input, target)
    w = None if weight is None else weight.astype(jnp.float32)

    def total(x, lw, lb):
        loss, target_weight = _losses(x, lw, t, lb, w, ignore_index, label_smoothing)
        if reduction == "mean":
            return jnp.sum(loss) / jnp.sum(target_weight)
        return jnp.sum(loss)

    lw = linear_weight.astype(jnp.float32)
    lb = None if linear_bias is None else linear_bias.astype(jnp.float32)
    loss, (gx, gw, gb) = jax.value_and_grad(total, argnums=(0, 1, 2))(
        x, lw, jnp.zeros(lw.shape[:1], jnp.float32) if lb is None else lb)
    dtype = input.dtype
    grad_input = gx.reshape(input.shape) if compute_input_grad else jnp.zeros((0, 0))
    grad_weight = gw if compute_linear_weight_grad else jnp.zeros((0, 0))
    grad_bias = gb if compute_linear_bias_grad else jnp.zeros((0,))
    return (loss.astype(dtype), grad_input.astype(dtype), grad_weight.astype(dtype),
            grad_bias.astype(dtype))


@lowers(_OPS._linear_cross_entropy_batch_chunked_no_reduction.default)
def linear_cross_entropy_batch_chunked_no_reduction(input, linear_weight, target, linear_bias,
                                                    weight, ignore_index, batch_chunk_size,
                                                    acc_policy, acc_dtype):
    """The per-sample loss ``(N,)`` (no label smoothing on this path)."""
    x, t = _rows(input, target)
    lb = None if linear_bias is None else linear_bias.astype(jnp.float32)
    w = None if weight is None else weight.astype(jnp.float32)
    loss, _ = _losses(x, linear_weight.astype(jnp.float32), t, lb, w, ignore_index, 0.0)
    return loss.reshape(input.shape[:-1]).astype(input.dtype)


# ---------------------------------------------------------------------- over chunks of tokens
#
# The causal-LM loss of a long sequence: ``sum(cross_entropy(x @ w.T, target))`` over the rows
# of ``x`` ([tokens, dim]) that are not ``ignore_index``, in chunks of rows, so that no more than
# one chunk's float32 logits ([rows, vocab]) exist at a time (1 x 32,768 tokens over a 32,000
# vocabulary: 4.2 GB of float32 logits whole, and as much again for their gradient). Loss and
# gradients come from one pass over the chunks: each chunk's logits, log-sum-exp and
# ``softmax - one_hot`` give its loss, its rows of ``d/dx`` and its share of ``d/dw`` (accumulated
# in float32), three matmuls per chunk, as a forward and backward through the full logits.
# bf16 / f16 operands are multiplied in their dtype with a float32 result; the logits' gradient
# is rounded to that dtype before its two products, as PyTorch's backward of a bf16 linear does.

CHUNK_LOGITS_BYTES = 256 * 2**20


def chunk_rows_for(vocab: int, logits_bytes: int = CHUNK_LOGITS_BYTES) -> int:
    """Most rows per chunk whose float32 logits ``[rows, vocab]`` fit in ``logits_bytes``
    (at least 8): 2,097 rows for a 32,000 vocabulary, 523 for Llama 3's 128,256."""
    return max(8, logits_bytes // (4 * vocab))


def chunk_layout(tokens: int, max_rows: int) -> tuple[int, int]:
    """``(chunks, rows)``: the fewest chunks of at most ``max_rows`` rows, of equal size, that
    cover ``tokens`` (the last padded where they do not divide it)."""
    chunks = -(-tokens // max(1, max_rows))
    return chunks, -(-tokens // chunks)


def _in_chunks(x, target, max_rows: int, ignore_index: int):
    chunks, rows = chunk_layout(x.shape[0], max_rows)
    pad = chunks * rows - x.shape[0]
    if pad:  # padded rows are ignored: no loss, no gradient
        x = jnp.pad(x, ((0, pad), (0, 0)))
        target = jnp.pad(target, (0, pad), constant_values=ignore_index)
    return x.reshape(chunks, rows, x.shape[-1]), target.reshape(chunks, rows)


def _product(a, b, contracting):
    """``a . b`` over ``contracting`` in their common dtype, the result in float32 (or wider)."""
    dtype = jnp.result_type(a, b)
    return lax.dot_general(a.astype(dtype), b.astype(dtype), (contracting, ((), ())),
                           precision=lax_precision(),
                           preferred_element_type=accumulator_dtype(a, b))


def _chunk_loss(logits, target, ignore_index: int):
    """``(summed loss, log-sum-exp per row, valid rows, target index)`` of one chunk."""
    valid = target != ignore_index
    index = jnp.where(valid, target, 0).astype(jnp.int32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, index[:, None], axis=1)[:, 0]
    return jnp.sum(jnp.where(valid, lse - picked, 0)), lse, valid, index


def chunked_loss_sum(x, w, target, ignore_index: int, max_rows: int):
    """The summed loss alone (one matmul per chunk)."""
    xs, ts = _in_chunks(x, target.reshape(-1), max_rows, ignore_index)

    def body(total, chunk):
        loss = _chunk_loss(_product(chunk[0], w, ((1,), (1,))), chunk[1], ignore_index)[0]
        return total + loss, None

    total, _ = lax.scan(body, jnp.zeros((), accumulator_dtype(x, w)), (xs, ts))
    return total


def chunked_loss_and_grads(x, w, target, ignore_index: int, max_rows: int):
    """``(summed loss, d loss / d x in x's dtype, d loss / d w in w's dtype)``."""
    tokens, dtype = x.shape[0], jnp.result_type(x, w)
    xs, ts = _in_chunks(x, target.reshape(-1), max_rows, ignore_index)

    def body(grad_w, chunk):
        xc, tc = chunk
        logits = _product(xc, w, ((1,), (1,)))
        loss, lse, valid, index = _chunk_loss(logits, tc, ignore_index)
        one_hot = jax.nn.one_hot(index, logits.shape[-1], dtype=logits.dtype)
        grad_logits = jnp.where(valid[:, None], jnp.exp(logits - lse[:, None]) - one_hot, 0)
        grad_logits = grad_logits.astype(dtype)
        grad_x = _product(grad_logits, w, ((1,), (0,))).astype(x.dtype)
        return grad_w + _product(grad_logits, xc, ((0,), (0,))), (loss, grad_x)

    grad_w, (losses, grad_x) = lax.scan(body, jnp.zeros(w.shape, accumulator_dtype(x, w)), (xs, ts))
    grad_x = grad_x.reshape(-1, x.shape[-1])[:tokens]
    return jnp.sum(losses), grad_x, grad_w.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def differentiable_loss_and_grads(x, w, target, ignore_index: int, max_rows: int):
    """:func:`chunked_loss_and_grads`, whose loss JAX differentiates by scaling the gradients
    it returns (the gradients' own cotangents are ignored: nothing differentiates them)."""
    return chunked_loss_and_grads(x, w, target, ignore_index, max_rows)


def _loss_and_grads_forward(x, w, target, ignore_index, max_rows):
    out = chunked_loss_and_grads(x, w, target, ignore_index, max_rows)
    return out, (out[1], out[2])


def _loss_and_grads_backward(ignore_index, max_rows, grads, cotangents):
    grad_x, grad_w = grads
    scale = cotangents[0]
    return ((scale * grad_x).astype(grad_x.dtype), (scale * grad_w).astype(grad_w.dtype), None)


differentiable_loss_and_grads.defvjp(_loss_and_grads_forward, _loss_and_grads_backward)
