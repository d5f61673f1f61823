"""Attention on a TPU through JAX's Pallas splash-attention kernel.

The XLA formulation (:func:`tpu_train.ops.attention.attention`) materialises f32 ``[B, H, S, S]``
scores in the forward and again in the backward; the kernel streams them through on-chip memory
in blocks. Measured on one TPU v5e (forward + backward, bf16, head_dim 64, causal): 8 x 16 heads
(8 kv) x 1024 tokens 3.0 ms against 6.0 ms, 4 x 32 (8) x 2048 8.0 ms against 20.4 ms; at 256
tokens the XLA form was faster (0.60 against 0.74 ms), hence :data:`MIN_SEQUENCE`.

Grouped-query heads are handled by the kernel's multi-query form, mapped over the kv heads (the
query heads of one kv head share its keys and values), and over the batch: K and V are never
repeated. The kernel takes no scale: the query is scaled before it (in its own dtype).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

# Below this many tokens the XLA formulation was faster on a v5e (module docstring).
MIN_SEQUENCE = 1024
_LANES = 128


def supported(query, key, value, attn_bias, is_causal) -> bool:
    """Can the kernel compute this call (same lengths, a causal or no mask, head_dim and
    sequence in whole 128-lane tiles, float inputs of one dtype)?"""
    b, h, sq, d = query.shape
    kv_heads, sk = key.shape[1], key.shape[2]
    return (attn_bias is None and sq == sk and sq >= MIN_SEQUENCE and sq % _LANES == 0
            and d % 64 == 0 and value.shape[-1] == d and h % kv_heads == 0
            and query.dtype == key.dtype == value.dtype
            and query.dtype in (jnp.bfloat16, jnp.float32))


@functools.lru_cache(maxsize=64)
def _kernel(sequence: int, group: int, is_causal: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib, splash_attention_mask as mask_lib)

    shape = (sequence, sequence)
    one = mask_lib.CausalMask(shape) if is_causal else mask_lib.FullMask(shape)
    block = 512 if sequence % 512 == 0 else _LANES
    blocks = kernel_lib.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    return kernel_lib.make_splash_mqa_single_device(
        mask_lib.MultiHeadMask([one] * group), block_sizes=blocks)


def attention(query, key, value, is_causal: bool, scale: float | None):
    """``out [B, H, S, D]`` of scaled-dot-product attention by the splash kernel (see
    :func:`supported`); differentiable (the kernel has its own backward)."""
    b, h, s, d = query.shape
    kv_heads = key.shape[1]
    group = h // kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scaled = (query.astype(jnp.float32) * scale).astype(query.dtype)
    kernel = _kernel(s, group, bool(is_causal))
    out = jax.vmap(jax.vmap(kernel))(scaled.reshape(b, kv_heads, group, s, d), key, value)
    return out.reshape(b, h, s, d).astype(query.dtype)
