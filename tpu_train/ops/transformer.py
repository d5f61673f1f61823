"""Lowerings of the fused inference kernels ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` call in ``eval()`` under ``no_grad``.

PyTorch's modules take their "fast path" on any device it lists as supported, which includes
the PrivateUse1 device: ``aten._native_multi_head_attention`` and
``aten._transformer_encoder_layer_fwd`` have CPU/CUDA kernels and no decomposition, so they are
lowered here, following the math of ATen's reference implementations
(``native/transformers/attention.cpp`` and ``transformer.cpp``). Inputs are batch-first
``[B, L, D]`` (the fast path is only taken for batch-first modules). Masks come merged by
``MultiheadAttention.merge_masks``: ``mask_type`` 0 is an ``[L, S]`` attention mask, 1 a
``[B, S]`` key-padding mask, 2 a mask broadcastable to ``[B, H, L, S]``; a boolean mask marks
positions to drop, a float mask is added to the scores. Rows with every key dropped give
zeros, as ATen's masked softmax does.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.scipy import special

from tpu_train.ops.matmul import accumulator_dtype, lax_precision
from tpu_train.ops.nn import softmax_along
from tpu_train.ops.registry import aten, lowers


def _linear(x, weight, bias):
    out = lax.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())), precision=lax_precision(),
                          preferred_element_type=accumulator_dtype(x, weight)).astype(x.dtype)
    return out if bias is None else out + bias


def _heads(x, num_heads):
    b, length, dim = x.shape
    return x.reshape(b, length, num_heads, dim // num_heads).transpose(0, 2, 1, 3)


def _mask_for_scores(mask, mask_type, scores):
    """The merged mask broadcast to the ``[B, H, L, S]`` scores."""
    if mask_type == 1 or (mask_type is None and mask.ndim == 2 and mask.shape[0] == scores.shape[0]
                          and mask.shape != scores.shape[-2:]):
        return mask[:, None, None, :]
    if mask.ndim == 2:
        return mask[None, None]
    if mask.ndim == 3:
        return mask[:, None]
    return mask


def _masked_softmax(scores, mask, mask_type):
    if mask is not None:
        mask = _mask_for_scores(mask, mask_type, scores)
        scores = (jnp.where(mask, -jnp.inf, scores) if mask.dtype == jnp.bool_
                  else scores + mask.astype(scores.dtype))
    return softmax_along(scores, -1, True)


def _attention(query, key, value, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
               mask, mask_type):
    """(projected attention output ``[B, L, D]``, per-head probabilities ``[B, H, L, S]``)."""
    dim = query.shape[-1]
    w_q, w_k, w_v = jnp.split(qkv_weight, 3, axis=0)
    b_q, b_k, b_v = (None, None, None) if qkv_bias is None else jnp.split(qkv_bias, 3)
    q = _heads(_linear(query, w_q, b_q), num_heads)
    k = _heads(_linear(key, w_k, b_k), num_heads)
    v = _heads(_linear(value, w_v, b_v), num_heads)
    q = q / math.sqrt(dim // num_heads)
    scores = jnp.einsum("bhld,bhsd->bhls", q, k, precision=lax_precision(),
                        preferred_element_type=jnp.float32)
    probs = _masked_softmax(scores, mask, mask_type).astype(query.dtype)
    out = jnp.einsum("bhls,bhsd->bhld", probs, v, precision=lax_precision(),
                     preferred_element_type=accumulator_dtype(probs, v)).astype(query.dtype)
    b, _, length, _ = out.shape
    out = out.transpose(0, 2, 1, 3).reshape(b, length, dim)
    return _linear(out, proj_weight, proj_bias), probs


@lowers(aten._native_multi_head_attention.default)
def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias,
                                proj_weight, proj_bias, mask=None, need_weights=True,
                                average_attn_weights=True, mask_type=None):
    out, probs = _attention(query, key, value, num_head, qkv_weight, qkv_bias, proj_weight,
                            proj_bias, mask, mask_type)
    if not need_weights:  # ATen returns an undefined tensor (None in Python)
        return out, None
    return out, (probs.mean(axis=1) if average_attn_weights else probs)


def _layer_norm(x, weight, bias, eps):
    up = x.astype(jnp.float32)
    mean = jnp.mean(up, axis=-1, keepdims=True)
    centered = up - mean
    out = centered * lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    return (out * weight + bias).astype(x.dtype)


def _feed_forward(x, weight_1, bias_1, weight_2, bias_2, use_gelu):
    hidden = _linear(x, weight_1, bias_1)
    if use_gelu:  # the exact (erf) GELU, as the fast path requires
        hidden = (hidden * 0.5 * (1 + special.erf(hidden * math.sqrt(0.5)))).astype(x.dtype)
    else:
        hidden = jnp.maximum(hidden, 0)
    return _linear(hidden, weight_2, bias_2)


@lowers(aten._transformer_encoder_layer_fwd.default)
def transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                                  proj_bias, use_gelu, norm_first, eps, norm_weight_1, norm_bias_1,
                                  norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1,
                                  ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    x = _layer_norm(src, norm_weight_1, norm_bias_1, eps) if norm_first else src
    x = _attention(x, x, x, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
                   mask_type)[0] + src
    if not norm_first:
        x = _layer_norm(x, norm_weight_1, norm_bias_1, eps)
    residual = x
    if norm_first:
        x = _layer_norm(x, norm_weight_2, norm_bias_2, eps)
    x = _feed_forward(x, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, use_gelu) + residual
    if not norm_first:
        x = _layer_norm(x, norm_weight_2, norm_bias_2, eps)
    return x
