"""Lowering of fused scaled-dot-product attention (the backend PyTorch reserves for custom devices).

``F.scaled_dot_product_attention`` on a custom device can dispatch to
``_scaled_dot_product_fused_attention_overrideable`` and its backward; lowering that pair keeps
attention as one unit in the traced graph (fewer nodes than the math decomposition).

Lowered for a TPU, the calls :func:`tpu_train.ops.attention_tpu.supported` accepts (causal,
unmasked or document-masked bf16 self-attention of at least ``attention_tpu.MIN_SEQUENCE``
tokens; the rule and its measurements are in that module) run JAX's Pallas splash-attention
kernels, forward and backward, a document mask (packed rows) as the kernels' segment ids, and
under ``attention_tpu.sliding_window`` a sliding-window mask as the kernels' ``LocalMask``;
everything else, and every other platform, takes the XLA formulation below.

Layout is ``[B, H, S, D]``. Grouped-query attention (fewer key/value heads than query heads) is
computed by viewing the query as ``[B, H_kv, G, S, D]`` and batching the dots over ``(B, H_kv)``,
so the repeated key/value heads are never materialised. Softmax and logsumexp are f32;
low-precision inputs keep their dtype in the dots (with an f32 accumulator), and the scores and
the probabilities are rounded to that dtype (before the softmax, before the ``P @ V`` product),
as PyTorch's math path does: the scores are the program's largest tensors.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy
from jax import lax

from tpu_train.ops import attention_tpu, context_attention, context_attention_tpu
from tpu_train.ops.matmul import dot_general
from tpu_train.ops.registry import aten, lowers


def _dot(a, b, contracting, batch=((0, 1), (0, 1))):
    return dot_general(a, b, contracting, batch)


def _grouped(x, kv_heads):
    """``[B, H, S, D]`` → ``[B, H_kv, G, S, D]`` with the query heads of one kv head together."""
    b, h, s, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, s, d)


def _scale_value(query, scale):
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale


def _bias_5d(attn_bias, query, key):
    """The additive bias as f32 ``[B, H_kv, G, Sq, Sk]`` (a boolean mask means keep where True)."""
    b, h, sq, _ = query.shape
    sk = key.shape[2]
    if attn_bias.dtype == jnp.bool_:
        attn_bias = jnp.where(attn_bias, 0.0, -jnp.inf)
    full = jnp.broadcast_to(attn_bias.astype(jnp.float32), (b, h, sq, sk))
    return full.reshape(b, key.shape[1], h // key.shape[1], sq, sk)


def _masked_scores(query, key, attn_bias, is_causal, scale):
    scores = _dot(_grouped(query, key.shape[1]), key, ((4,), (3,))) * _scale_value(query, scale)
    if _probabilities_dtype(query) != jnp.float32:
        # Rounded to the inputs' 16-bit dtype, as PyTorch's math path rounds q k^T. XLA keeps
        # the [B, H, Sq, Sk] scores in HBM for the softmax's passes and the backward's, so
        # this halves the largest tensors of the program: forward + backward, causal, bf16,
        # head_dim 64, compiled for a v5e (cost analysis, bytes accessed), 8 x 16 (8 kv) x
        # 1024 tokens 3.93 -> 2.57 GB, 4 x 32 (8) x 2048 14.9 -> 9.58 GB, 4 x 8 (4) x 256
        # 81.5 -> 60.8 MB (JAX's own derivative of the plain form: 4.61 GB, 17.4 GB, 86.6 MB).
        scores = scores.astype(query.dtype)
    scores = scores.astype(jnp.float32)
    if attn_bias is not None:
        scores = scores + _bias_5d(attn_bias, query, key)
    if is_causal:
        sq, sk = scores.shape[-2:]
        # Top-left aligned, as torch's is_causal: query i sees keys 0..i.
        keep = lax.broadcasted_iota(jnp.int32, (sq, sk), 0) >= lax.broadcasted_iota(jnp.int32, (sq, sk), 1)
        scores = jnp.where(keep, scores, -jnp.inf)
    return scores


def _dropout_keep(seed, dropout_p, shape):
    return jax.random.bernoulli(jax.random.key(seed), 1.0 - dropout_p, shape)


def _has_dropout(dropout_p):
    # A traced probability may be non-zero, so it always takes the dropout path.
    return not (isinstance(dropout_p, (int, float)) and dropout_p == 0)


def _probabilities_dtype(value):
    return value.dtype if value.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


def _softmax_with_logsumexp(scores):
    """Probabilities and logsumexp of f32 scores; a fully masked row (all -inf) gives zero
    probabilities and a -inf logsumexp, like torch's safe softmax."""
    # The shift is a constant to autodiff: neither output depends on it.
    row_max = lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    safe_max = jnp.where(jnp.isneginf(row_max), 0.0, row_max)
    shifted = jnp.exp(scores - safe_max)
    total = jnp.sum(shifted, axis=-1, keepdims=True)
    probs = jnp.where(total == 0, 0.0, shifted / jnp.where(total == 0, 1.0, total))
    return probs, (safe_max + jnp.log(total))[..., 0]


def _forward(query, key, value, attn_bias, is_causal, scale):
    """``(out, logsumexp)`` without dropout: the TPU kernels where they apply, else the XLA form."""
    if not attention_tpu.supported(query, key, value, attn_bias, is_causal):
        return _attention_forward(query, key, value, attn_bias, is_causal, scale)
    if attn_bias is not None:  # a boolean mask: the kernels with segment ids if a document mask
        def with_kernels(q, k, v, mask):
            return attention_tpu.for_document_mask(
                mask, q.shape[0],
                lambda segments: attention_tpu.forward(q, k, v, True, scale, segments,
                                                       attention_tpu.current_window()),
                lambda: _attention_forward(q, k, v, mask, False, scale))

        return attention_tpu.on_tpu(
            (query, key, value, attn_bias), with_kernels,
            lambda q, k, v, mask: _attention_forward(q, k, v, mask, False, scale))
    return attention_tpu.on_tpu(
        (query, key, value),
        lambda q, k, v: attention_tpu.forward(q, k, v, is_causal, scale),
        lambda q, k, v: _attention_forward(q, k, v, None, is_causal, scale))


def _attention_forward(query, key, value, attn_bias, is_causal, scale):
    """``(out [B, H, Sq, Dv], logsumexp [B, H, Sq])`` without dropout, the XLA form."""
    b, h, sq, _ = query.shape
    probs, logsumexp = _softmax_with_logsumexp(_masked_scores(query, key, attn_bias, is_causal, scale))
    out = _dot(probs.astype(_probabilities_dtype(value)), value, ((4,), (2,)))
    # Rounded to the inputs' dtype, as PyTorch's result is (the dot accumulates in f32).
    out = out.astype(jnp.result_type(query, value))
    return out.reshape(b, h, sq, value.shape[-1]), logsumexp.reshape(b, h, sq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def attention(query, key, value, attn_bias, is_causal, scale):
    """Attention as one differentiable unit: ``(out, logsumexp)``.

    Differentiated by JAX (a compiled step's loss graph), its backward is the fused one below
    (probabilities recomputed from the saved logsumexp, the softmax gradient from
    ``rowsum(dO * O)``), not JAX's derivative of each forward op, which keeps f32 ``[B, H, S, S]``
    intermediates alive from the forward and adds a separate softmax-backward pass."""
    return _forward(query, key, value, attn_bias, is_causal, scale)


def _attention_vjp_forward(query, key, value, attn_bias, is_causal, scale):
    out, logsumexp = _forward(query, key, value, attn_bias, is_causal, scale)
    return (out, logsumexp), (query, key, value, attn_bias, out, logsumexp)


def _attention_vjp_backward(is_causal, scale, residuals, cotangents):
    query, key, value, attn_bias, out, logsumexp = residuals
    grad_out = cotangents[0].astype(out.dtype)  # the logsumexp output is not differentiated
    grads = _attention_backward(grad_out, query, key, value, attn_bias, (True, True, True, True),
                                out, logsumexp, 0.0, is_causal, None, scale)
    grad_bias = None
    if attn_bias is not None:
        grad_bias = (numpy.zeros(attn_bias.shape, jax.dtypes.float0)
                     if attn_bias.dtype == jnp.bool_ else grads[3].astype(attn_bias.dtype))
    # Gradients in the inputs' dtypes (the dots accumulate in f32): a bf16 step stays bf16.
    return (grads[0].astype(query.dtype), grads[1].astype(key.dtype),
            grads[2].astype(value.dtype), grad_bias)


attention.defvjp(_attention_vjp_forward, _attention_vjp_backward)


def _dropout_argument(args, kwargs):
    return args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)


@lowers(aten._scaled_dot_product_fused_attention_overrideable.default, random=True,
        random_if=lambda args, kwargs: _has_dropout(_dropout_argument(args, kwargs)))
def scaled_dot_product_fused_attention(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False,
                                       return_debug_mask=False, *, scale=None, rng_key=None):
    sq, sk = query.shape[2], key.shape[2]
    seed = jnp.zeros((), jnp.int32)
    offset = jnp.zeros((), jnp.int32)
    if context_attention.applies(query, key, attn_bias, is_causal, dropout_p):
        out, logsumexp = context_attention_tpu.attention(query, key, value, scale)
        return out, logsumexp, None, None, sq, sk, seed, offset, None
    if not _has_dropout(dropout_p):
        out, logsumexp = attention(query, key, value, attn_bias, bool(is_causal), scale)
        return out, logsumexp, None, None, sq, sk, seed, offset, None
    b, h = query.shape[:2]
    probs, logsumexp = _softmax_with_logsumexp(_masked_scores(query, key, attn_bias, is_causal, scale))
    seed = jax.random.randint(rng_key, (), 0, jnp.iinfo(jnp.int32).max, jnp.int32)
    probs = jnp.where(_dropout_keep(seed, dropout_p, probs.shape), probs / (1.0 - dropout_p), 0.0)
    out = _dot(probs.astype(_probabilities_dtype(value)), value, ((4,), (2,)))
    return (out.reshape(b, h, sq, value.shape[-1]), logsumexp.reshape(b, h, sq), None, None, sq, sk,
            seed, offset, None)


def _reduce_to_shape(grad, shape):
    """Sum a broadcast gradient back to ``shape`` (the bias may broadcast over batch/heads)."""
    lead = grad.ndim - len(shape)
    grad = jnp.sum(grad, axis=tuple(range(lead))) if lead else grad
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return jnp.sum(grad, axis=axes, keepdims=True) if axes else grad


@lowers(aten._scaled_dot_product_fused_attention_overrideable_backward.default)
def scaled_dot_product_fused_attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out,
                                                logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                                is_causal, philox_seed, philox_offset, *, scale=None):
    if context_attention.applies(query, key, attn_bias, is_causal, dropout_p):
        # PyTorch's backward traced (not JAX's): the split forward's derivative, recomputed.
        _, pullback = jax.vjp(
            lambda q, k, v: context_attention_tpu.attention(q, k, v, scale)[0],
            query, key, value)
        grads = pullback(grad_out.astype(out.dtype))
        return tuple(g if wanted else None for g, wanted in zip(grads, grad_input_mask)) + (None,)
    return _attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp,
                               dropout_p, is_causal, philox_seed, scale)


def _attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp,
                        dropout_p, is_causal, philox_seed, scale):
    """``(dq, dk, dv, dbias)`` (None where ``grad_input_mask`` says so): the TPU kernels where
    they apply, else the XLA form."""
    if not attention_tpu.supported(query, key, value, attn_bias, is_causal, dropout_p):
        return _xla_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out,
                             logsumexp, dropout_p, is_causal, philox_seed, scale)
    def with_xla(g, q, k, v, o, lse, mask=None):
        return tuple(grad.astype(x.dtype) for grad, x in zip(_xla_backward(
            g, q, k, v, mask, (True, True, True, False), o, lse, 0.0, is_causal, None,
            scale), (q, k, v)))

    if attn_bias is None:
        grads = attention_tpu.on_tpu(
            (grad_out, query, key, value, out, logsumexp),
            lambda *operands: attention_tpu.backward(*operands, is_causal, scale), with_xla)
    else:  # a boolean mask: the kernels with segment ids if a document mask (as _forward)
        def with_kernels(g, q, k, v, o, lse, mask):
            return attention_tpu.for_document_mask(
                mask, q.shape[0],
                lambda segments: attention_tpu.backward(g, q, k, v, o, lse, True, scale, segments,
                                                        attention_tpu.current_window()),
                lambda: with_xla(g, q, k, v, o, lse, mask))

        grads = attention_tpu.on_tpu((grad_out, query, key, value, out, logsumexp, attn_bias),
                                     with_kernels, with_xla)
    return tuple(g if wanted else None for g, wanted in zip(grads, grad_input_mask)) + (None,)


def _xla_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp,
                  dropout_p, is_causal, philox_seed, scale):
    b, h, sq, d = query.shape
    kv_heads, sk = key.shape[1], key.shape[2]
    scale_value = _scale_value(query, scale)
    scores = _masked_scores(query, key, attn_bias, is_causal, scale)
    lse = logsumexp.astype(jnp.float32).reshape(b, kv_heads, h // kv_heads, sq, 1)
    probs = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(scores - jnp.where(jnp.isneginf(lse), 0.0, lse)))
    kept = probs
    if _has_dropout(dropout_p):
        keep = _dropout_keep(philox_seed.astype(jnp.int32), dropout_p, probs.shape)
        kept = jnp.where(keep, probs / (1.0 - dropout_p), 0.0)
    g5 = _grouped(grad_out, kv_heads)
    low = _probabilities_dtype(value)

    # dV = P_dropped^T dO, summed over the query heads sharing a kv head.
    grad_value = _dot(kept.astype(low), g5, ((2, 3), (2, 3)))
    grad_kept = _dot(g5, value, ((4,), (3,))).astype(jnp.float32)
    grad_probs = jnp.where(keep, grad_kept / (1.0 - dropout_p), 0.0) if _has_dropout(dropout_p) else grad_kept
    # Softmax backward: sum_j P_ij dP_ij equals the row of dO · O (also with dropout).
    row_dot = jnp.sum(_grouped(grad_out, kv_heads).astype(jnp.float32) *
                      _grouped(out, kv_heads).astype(jnp.float32), axis=-1, keepdims=True)
    grad_scores = probs * (grad_probs - row_dot)

    grad_query = grad_key = grad_bias = None
    if grad_input_mask[0]:
        grad_query = (_dot(grad_scores.astype(low), key, ((4,), (2,))) * scale_value).reshape(query.shape)
    if grad_input_mask[1]:
        grad_key = _dot(grad_scores.astype(low), _grouped(query, kv_heads), ((2, 3), (2, 3))) * scale_value
    if not grad_input_mask[2]:
        grad_value = None
    if grad_input_mask[3] and attn_bias is not None and attn_bias.dtype != jnp.bool_:
        grad_bias = _reduce_to_shape(grad_scores.reshape(b, h, sq, sk), attn_bias.shape)
    return grad_query, grad_key, grad_value, grad_bias
