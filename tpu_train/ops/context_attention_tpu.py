"""Context-parallel attention on a TPU: each device's share through the splash kernels.

Under a sequence split (:mod:`tpu_train.ops.context_attention`) each device holds two chunks
of ``C`` queries (zig-zag: chunks ``i`` and ``2N - 1 - i``) and gathers the whole sequence's
keys and values. Lowered for a TPU, that share runs as ONE call of JAX's Pallas splash
attention kernel (:mod:`tpu_train.ops.attention_tpu` runs the same kernels without a split):
the shard's ``2C`` queries against the ``S`` keys put back in sequence order, the mask causal
by the queries' true positions (the kernel's ``q_sequence``: the splash library's way to mask
a permuted query sequence, as its ``CausalMask`` evaluates it inside the kernel), so the
kernel skips every block of keys after the chunk it serves and a shard computes only its
``(2N + 1) C^2`` causal pairs, as many on every device. The backward is the kernel library's
own backward rule (``attention_tpu.kernel_grads``) from the forward's output and logsumexp.

The kernel's block tables (which blocks of keys each block of queries sees, and which to
fetch next) depend on the shard. They are built on the host for every shard at once, as the
splash library's ``process_mask`` builds them for a query sequence sharded ``N`` ways (its
grid not shrunk), but from block extremes in NumPy rather than by evaluating the ``S x S``
mask block by block, which takes minutes at 10^5 tokens (``tests/ops`` checks the tables
equal the library's); each device takes its rows by its index on the axis.

Where the kernels do not apply (:func:`supported`) the blockwise XLA form runs, on every
platform; as for :mod:`.attention_tpu`, a program lowered for another platform takes it too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy
from jax import lax

from tpu_train.ops import attention_tpu, context_attention

__all__ = ["attention", "block_tables", "natural_order", "shard_attention", "supported"]

_LANES = 128
_BLOCKS = (512, 256, 128)


def supported(query, key, value) -> bool:
    """Does the active split's attention take the kernels on a TPU? The heads and dtypes
    :func:`attention_tpu.kernels_take` accepts, and chunks of a multiple of 128 tokens (the
    kernel's lane tile: a block of queries lies within one chunk); else the blockwise form."""
    split = context_attention.active()
    chunk = split.seq_len // (2 * split.shards)
    return chunk % _LANES == 0 and attention_tpu.kernels_take(query, key, value)


def attention(query, key, value, scale):
    """``(out, logsumexp)`` of the active split's causal attention (as
    :func:`context_attention.attention`): per device, the kernels where the program is
    lowered for a TPU and :func:`supported` holds, else the blockwise XLA form."""
    if not supported(query, key, value):
        return context_attention.attention(query, key, value, scale)
    shards = context_attention.active().shards
    scale = _scale(query, scale)

    def with_kernels(q, k, v):
        return context_attention.attention(
            q, k, v, scale, local=lambda q_, k_, v_, shard: shard_attention(
                q_, k_, v_, shard, shards, scale))

    return attention_tpu.on_tpu(
        (query, key, value), with_kernels,
        lambda q, k, v: context_attention.attention(q, k, v, scale))


def _scale(query, scale) -> float:
    return query.shape[-1] ** -0.5 if scale is None else float(scale)


def natural_order(x, shards: int):
    """``[b, h, S, d]`` gathered in the zig-zag layout (shard ``i``: chunks ``i`` and
    ``2N - 1 - i``) -> the same in sequence order."""
    b, h, s, d = x.shape
    pairs = x.reshape(b, h, shards, 2, s // (2 * shards), d)
    return jnp.concatenate([pairs[:, :, :, 0], jnp.flip(pairs[:, :, :, 1], axis=2)],
                           axis=2).reshape(b, h, s, d)


def shard_attention(query, keys, values, shard, shards: int, scale: float):
    """One device's ``(out, logsumexp)`` by the kernels: its queries ``[b, h, 2C, d]``
    (shard ``shard`` of ``shards``, an int or a traced index) against ``keys`` and ``values``
    ``[b, h_kv, S, d]`` gathered in the zig-zag layout. Differentiable (the kernels'
    backward)."""
    shard = jnp.asarray(shard, jnp.int32)
    return _kernel_attention(query, natural_order(keys, shards), natural_order(values, shards),
                             shard, shards, float(scale))


def _block(chunk: int) -> int:
    return next(b for b in _BLOCKS if chunk % b == 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _kernel_attention(query, keys, values, shard, shards, scale):
    return _forward(query, keys, values, shard, shards, scale)


def _grouped(x, kv_heads):
    b, h, s, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, s, d)


def _scaled(query, scale):
    return (query.astype(jnp.float32) * scale).astype(query.dtype)


def _forward(query, keys, values, shard, shards, scale):
    b, h, rows, d = query.shape
    kv_heads = keys.shape[1]
    kernel = _shard_kernel(keys.shape[2], shards, h // kv_heads, shard)
    with attention_tpu.kernel_precision(query.dtype):
        out, (logsumexp,) = jax.vmap(jax.vmap(kernel))(
            _grouped(_scaled(query, scale), kv_heads), keys, values)
    return out.reshape(b, h, rows, d).astype(query.dtype), logsumexp.reshape(b, h, rows)


def _vjp_forward(query, keys, values, shard, shards, scale):
    out, logsumexp = _forward(query, keys, values, shard, shards, scale)
    return (out, logsumexp), (query, keys, values, shard, out, logsumexp)


def _vjp_backward(shards, scale, residuals, cotangents):
    query, keys, values, shard, out, logsumexp = residuals
    b, h, rows, d = query.shape
    kv_heads = keys.shape[1]
    group = h // kv_heads
    kernel = _shard_kernel(keys.shape[2], shards, group, shard)

    def one(q, k, v, o, lse, do):
        return attention_tpu.kernel_grads(kernel, q, k, v, o, lse, do)

    with attention_tpu.kernel_precision(query.dtype):
        grad_scaled, grad_keys, grad_values = jax.vmap(jax.vmap(one))(
            _grouped(_scaled(query, scale), kv_heads), keys, values,
            _grouped(out.astype(query.dtype), kv_heads),
            logsumexp.astype(jnp.float32).reshape(b, kv_heads, group, rows),
            _grouped(cotangents[0].astype(query.dtype), kv_heads))
    grad_query = (grad_scaled.astype(jnp.float32) * scale).astype(query.dtype)
    return (grad_query.reshape(query.shape), grad_keys.astype(keys.dtype),
            grad_values.astype(values.dtype), None)


_kernel_attention.defvjp(_vjp_forward, _vjp_backward)


def _shard_kernel(seq: int, shards: int, group: int, shard):
    """The multi-query kernel of shard ``shard`` (traced): the library's kernel settings for
    ``group`` query heads, with that shard's rows of :func:`block_tables`."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib, splash_attention_mask_info as info_lib)

    block = _block(seq // (2 * shards))
    tables = block_tables(seq, shards, block)
    rows = seq // shards
    blocks = rows // block

    def mine(table, length):  # the shard's rows: the queries' axis, the tables' second
        axis = 1 if table.ndim > 1 else 0
        return lax.dynamic_slice_in_dim(jnp.asarray(table), shard * length, length, axis=axis)

    def info(data_next):
        return info_lib.MaskInfo(
            data_next=mine(data_next, blocks), mask_next=None,
            block_mask=mine(tables["block_mask"], blocks), partial_mask_blocks=None,
            q_sequence=mine(tables["q_sequence"], rows))

    settings = _settings(group, block, attention_tpu.is_interpreted())
    return kernel_lib.SplashAttentionKernel(info(tables["data_next"]), info(tables["data_next"]),
                                            info(tables["data_next_dkv"]), **settings)


@functools.lru_cache(maxsize=16)
def _settings(group: int, block: int, interpret: bool) -> dict:
    """The splash library's settings of a multi-query causal kernel (its mask function, block
    sizes, mask value), taken from the kernel it makes for one block: the tables are ours."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib, splash_attention_mask as mask_lib)

    sizes = kernel_lib.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    with jax.ensure_compile_time_eval():
        kernel = kernel_lib.make_splash_mqa_single_device(
            mask_lib.MultiHeadMask([mask_lib.CausalMask((block, block))] * group),
            block_sizes=sizes, save_residuals=True, interpret=interpret)
    return dict(kernel.kwargs)


@functools.lru_cache(maxsize=8)
def block_tables(seq: int, shards: int, block: int) -> dict[str, numpy.ndarray]:
    """The kernel's tables for the zig-zag layout's ``seq`` queries (all shards, in layout
    order) against ``seq`` keys in sequence order, blocks of ``block``: ``q_sequence``
    (each query's position), ``block_mask`` ``[1, S / block, S / block]`` (0: no key of the
    block visible to the block's queries, 2: all, 1: some), ``data_next`` (the key block to
    fetch at each step of the forward's and dQ's grid: the next visible one of the shard's
    rows, in grid order) and ``data_next_dkv`` (the query block, dK/dV's grid order: key
    blocks outermost). NumPy, as the library's ``process_mask`` with ``q_seq_shards=shards``
    and no grid shrinking makes them."""
    positions = context_attention.zigzag_positions(seq, shards).astype(numpy.int32)
    query_blocks = positions.reshape(-1, block)
    first_key = numpy.arange(0, seq, block)
    full = query_blocks.min(axis=1)[:, None] >= (first_key + block - 1)[None, :]
    some = query_blocks.max(axis=1)[:, None] >= first_key[None, :]
    block_mask = numpy.where(full, 2, numpy.where(some, 1, 0)).astype(numpy.int32)
    per_shard = numpy.split(block_mask != 0, shards, axis=0)
    forward = numpy.concatenate([_next_visible(part) for part in per_shard], axis=0)
    dkv = numpy.concatenate([_next_visible(part.T).T for part in per_shard], axis=0)
    return {"q_sequence": positions, "block_mask": _small(block_mask)[None],
            "data_next": _small(forward)[None], "data_next_dkv": _small(dkv)[None]}


def _next_visible(visible: numpy.ndarray) -> numpy.ndarray:
    """For each cell of ``visible`` (a grid, walked row by row), the column of the first
    visible cell at or after it, wrapping to the first visible cell."""
    where = numpy.flatnonzero(visible)
    following = where[numpy.searchsorted(where, numpy.arange(visible.size)) % where.size]
    return (following % visible.shape[1]).reshape(visible.shape).astype(numpy.int32)


def _small(table: numpy.ndarray) -> numpy.ndarray:
    """The narrowest integer type that holds ``table`` (the tables live in scalar memory)."""
    for kind in (numpy.int8, numpy.int16):
        if table.max() <= numpy.iinfo(kind).max:
            return table.astype(kind)
    return table
