"""Causal attention over sequences split across a mesh axis (context parallelism).

A program lowered inside :func:`sequence_split` holds every sequence split over the mesh's
``context`` axis in the *zig-zag* layout: the sequence is cut into ``2N`` equal chunks and shard
``i`` of ``N`` holds chunks ``i`` and ``2N - 1 - i`` (:func:`zigzag_positions`). Under a causal
mask a shard holding only the sequence's end would attend to N times more keys than one
holding its start; with the two chunks paired this way every shard attends to the same number
of (query, key) pairs, ``(2N + 1) C^2`` for chunks of ``C`` tokens, so none idles.

Whoever lowers the program permutes the tokens into that layout and gives each its rotary
position (``tpu_train.parallel.context``); the model's causal attention then arrives here as
``is_causal`` over the permuted sequence, and :func:`attention` computes it in a ``shard_map``:
each shard all-gathers the keys and values over the axis (their gradients are reduce-scattered
back), keeps its own queries, and masks by the tokens' true positions, one block of keys at a
time (:func:`blockwise_attention`): ``[b, h, S / 2N, KEY_BLOCK]`` score tiles, never the
``[S / N, S]`` scores of the shard whole, so that sequences of 10^5 tokens fit. Lowered for a
TPU, ``tpu_train.ops.context_attention_tpu`` gives :func:`attention` the shard's computation
as the splash kernels instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy
from jax import lax
from jax.sharding import PartitionSpec

from tpu_train.ops.matmul import dot_general

__all__ = ["SequenceSplit", "active", "applies", "attention", "blockwise_attention",
           "lowering_key", "sequence_split", "shard_attention", "zigzag_positions"]


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """Sequences of ``seq_len`` tokens split over ``axis`` of ``mesh`` (zig-zag); the batch over
    ``batch_axes`` (the activations' batch axes, ``tpu_train.compile.spmd.BATCH_AXES``; those
    the mesh lacks are skipped) and heads over ``head_axis`` where they divide."""

    mesh: Any
    seq_len: int
    axis: str = "context"
    batch_axes: tuple[str, ...] = ("data", "fsdp", "expert")
    head_axis: str = "tensor"

    @property
    def shards(self) -> int:
        return int(self.mesh.shape[self.axis])


_SPLIT = contextvars.ContextVar("tpu_train_sequence_split", default=None)


def zigzag_positions(seq_len: int, shards: int) -> numpy.ndarray:
    """The position of each token of the zig-zag layout, in layout order: shard ``i``'s block
    is chunk ``i`` then chunk ``2 * shards - 1 - i`` of ``seq_len // (2 * shards)`` tokens."""
    if seq_len % (2 * shards):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x {shards} "
                         f"equal chunks (context parallelism over {shards} devices)")
    chunk = seq_len // (2 * shards)
    order = [c for i in range(shards) for c in (i, 2 * shards - 1 - i)]
    return numpy.concatenate([numpy.arange(c * chunk, (c + 1) * chunk) for c in order])


@contextlib.contextmanager
def sequence_split(mesh, seq_len: int, axis: str = "context"):
    """Attention lowered inside treats causal self-attention over ``seq_len`` tokens as split
    over ``axis`` of ``mesh`` in the zig-zag layout. A mesh without the axis, or with it of
    size 1, changes nothing."""
    split = None
    if mesh is not None and int(dict(mesh.shape).get(axis, 1)) > 1:
        split = SequenceSplit(mesh, int(seq_len), axis)
    token = _SPLIT.set(split)
    try:
        yield split
    finally:
        _SPLIT.reset(token)


def active() -> SequenceSplit | None:
    return _SPLIT.get()


def lowering_key() -> tuple:
    """Part of the key of any cache of traced functions (as ``attention_tpu.lowering_key``)."""
    split = _SPLIT.get()
    return () if split is None else (split.axis, split.shards, split.seq_len)


def applies(query, key, attn_bias, is_causal, dropout_p) -> bool:
    """Is this call the model's causal self-attention over a split sequence?"""
    split = _SPLIT.get()
    no_dropout = isinstance(dropout_p, (int, float)) and dropout_p == 0
    return (split is not None and bool(is_causal) and attn_bias is None and no_dropout
            and query.shape[2] == key.shape[2] == split.seq_len)


def _divisible_axes(mesh, axes: tuple[str, ...], size: int):
    ways = math.prod(int(mesh.shape[a]) for a in axes if a in mesh.shape)
    kept = tuple(a for a in axes if a in mesh.shape)
    return kept if kept and ways > 1 and size % ways == 0 else None


def attention(query, key, value, scale, local=None):
    """``(out, logsumexp)`` of causal attention over the active split's sequence, computed per
    shard: its ``[b, h, S / N, d]`` queries against the ``[b, h_kv, S, d]`` keys and values
    gathered over the axis (in the layout's order), by :func:`shard_attention` or by
    ``local(queries, keys, values, shard)`` (``shard``: the device's index on the axis; the
    TPU kernels, ``tpu_train.ops.context_attention_tpu``)."""
    split = _SPLIT.get()
    mesh, axis, shards = split.mesh, split.axis, split.shards
    positions = jnp.asarray(zigzag_positions(split.seq_len, shards), jnp.int32)
    local_len = split.seq_len // shards
    batch = _divisible_axes(mesh, split.batch_axes, query.shape[0])
    heads = split.head_axis if (split.head_axis in mesh.shape and
                                query.shape[1] % mesh.shape[split.head_axis] == 0 and
                                key.shape[1] % mesh.shape[split.head_axis] == 0) else None
    spec = PartitionSpec(batch, heads, axis, None)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)

    def per_shard(q, k, v):
        keys = lax.all_gather(k, axis, axis=2, tiled=True)
        values = lax.all_gather(v, axis, axis=2, tiled=True)
        shard = lax.axis_index(axis)
        if local is not None:
            return local(q, keys, values, shard)
        mine = lax.dynamic_slice_in_dim(positions, shard * local_len, local_len)
        return shard_attention(q, keys, values, mine, positions, scale)

    return jax.shard_map(per_shard, mesh=mesh, in_specs=(spec, spec, spec),
                         out_specs=(spec, PartitionSpec(batch, heads, axis)),
                         check_vma=False)(query, key, value)


def shard_attention(query, keys, values, query_positions, key_positions, scale):
    """One shard's ``(out, logsumexp)``: its queries (two chunks, positions
    ``query_positions``) against the whole sequence's keys and values (``key_positions``).
    The chunks run one after the other, so each skips the key blocks after it."""
    half = query.shape[2] // 2
    halves = [blockwise_attention(query[:, :, c * half:(c + 1) * half], keys, values,
                                  query_positions[c * half:(c + 1) * half], key_positions,
                                  scale) for c in range(2)]
    return tuple(jnp.concatenate(parts, axis=2) for parts in zip(*halves))


# Keys per block of the blockwise attention: a [b, h, queries, KEY_BLOCK] f32 score tile.
KEY_BLOCK = 512


def _key_block(keys: int, query_positions_len: int) -> int:
    return math.gcd(keys, query_positions_len, KEY_BLOCK)


def _blocks(x, block):
    """``[b, h, s, d]`` -> ``[s / block, b, h, block, d]``, the scan's leading axis."""
    b, h, s, d = x.shape
    return x.reshape(b, h, s // block, block, d).transpose(2, 0, 1, 3, 4)


def _scores(q5, k_block, q_pos, k_pos, scale):
    scores = dot_general(q5, k_block, ((4,), (3,)), ((0, 1), (0, 1))).astype(jnp.float32)
    visible = q_pos[:, None] >= k_pos[None, :]
    return jnp.where(visible, scores * scale, -jnp.inf), visible


def _low(value):
    return value.dtype if value.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def blockwise_attention(query, key, value, query_positions, key_positions, scale):
    """Causal attention by position: query ``i`` sees the keys whose position is at most its
    own. ``(out [b, h, sq, d], logsumexp [b, h, sq])``.

    A loop over blocks of keys with an online softmax (flash attention's arithmetic in XLA):
    the scores exist one ``[b, h, sq, KEY_BLOCK]`` tile at a time, and a block every key of
    which lies after every query is skipped (``lax.cond``), so a shard's work is the causal
    pairs it holds, which the zig-zag layout equalises. The backward recomputes each tile
    from the saved logsumexp.
    """
    return _blockwise_forward(query, key, value, query_positions, key_positions, scale)


def _blockwise_forward(query, key, value, query_positions, key_positions, scale):
    b, h, sq, d = query.shape
    kv_heads = key.shape[1]
    block = _key_block(key.shape[2], sq)
    q5 = query.reshape(b, kv_heads, h // kv_heads, sq, d)
    last = jnp.max(query_positions)

    def step(carry, xs):
        k_block, v_block, k_pos = xs

        def attend(carry):
            out, row_max, total = carry
            scores, _ = _scores(q5, k_block, query_positions, k_pos, scale)
            new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
            shift = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
            probs = jnp.exp(scores - shift[..., None])
            rescale = jnp.exp(row_max - shift)
            out = out * rescale[..., None] + dot_general(
                probs.astype(_low(value)), v_block, ((4,), (2,)), ((0, 1), (0, 1)))
            return out, new_max, total * rescale + jnp.sum(probs, axis=-1)

        return lax.cond(jnp.min(k_pos) <= last, attend, lambda c: c, carry), None

    init = (jnp.zeros((b, kv_heads, h // kv_heads, sq, value.shape[-1]), jnp.float32),
            jnp.full((b, kv_heads, h // kv_heads, sq), -jnp.inf, jnp.float32),
            jnp.zeros((b, kv_heads, h // kv_heads, sq), jnp.float32))
    (out, row_max, total), _ = lax.scan(
        step, init, (_blocks(key, block), _blocks(value, block),
                     key_positions.reshape(-1, block)))
    # Every query sees at least its own key: total > 0.
    out = (out / total[..., None]).astype(jnp.result_type(query, value))
    logsumexp = row_max + jnp.log(total)
    return out.reshape(b, h, sq, value.shape[-1]), logsumexp.reshape(b, h, sq)


def _blockwise_vjp_forward(query, key, value, query_positions, key_positions, scale):
    out, logsumexp = _blockwise_forward(query, key, value, query_positions, key_positions,
                                        scale)
    return (out, logsumexp), (query, key, value, query_positions, key_positions, out, logsumexp)


def _blockwise_vjp_backward(scale, residuals, cotangents):
    query, key, value, query_positions, key_positions, out, logsumexp = residuals
    b, h, sq, d = query.shape
    kv_heads = key.shape[1]
    group = h // kv_heads
    block = _key_block(key.shape[2], sq)
    q5 = query.reshape(b, kv_heads, group, sq, d)
    g5 = cotangents[0].astype(out.dtype).reshape(b, kv_heads, group, sq, -1)
    lse = logsumexp.reshape(b, kv_heads, group, sq)
    # sum_j P_ij dP_ij = dO_i . O_i (the softmax backward's row term).
    row_dot = jnp.sum(g5.astype(jnp.float32) *
                      out.reshape(g5.shape).astype(jnp.float32), axis=-1)
    last = jnp.max(query_positions)

    def step(grad_query, xs):
        k_block, v_block, k_pos = xs

        def attend(grad_query):
            scores, visible = _scores(q5, k_block, query_positions, k_pos, scale)
            probs = jnp.where(visible, jnp.exp(scores - lse[..., None]), 0.0)
            grad_value = dot_general(probs.astype(_low(value)), g5, ((2, 3), (2, 3)),
                                     ((0, 1), (0, 1)))
            grad_probs = dot_general(g5, v_block, ((4,), (3,)), ((0, 1), (0, 1)))
            grad_scores = (probs * (grad_probs.astype(jnp.float32) - row_dot[..., None])
                           ).astype(_low(query))
            grad_query = grad_query + dot_general(grad_scores, k_block, ((4,), (2,)),
                                                  ((0, 1), (0, 1))) * scale
            grad_key = dot_general(grad_scores, q5, ((2, 3), (2, 3)), ((0, 1), (0, 1))) * scale
            return grad_query, (grad_key.astype(key.dtype), grad_value.astype(value.dtype))

        def skip(grad_query):
            empty = jnp.zeros((b, kv_heads, block, d), key.dtype)
            return grad_query, (empty, jnp.zeros((b, kv_heads, block, value.shape[-1]),
                                                 value.dtype))

        return lax.cond(jnp.min(k_pos) <= last, attend, skip, grad_query)

    grad_query, (grad_key, grad_value) = lax.scan(
        step, jnp.zeros(q5.shape, jnp.float32),
        (_blocks(key, block), _blocks(value, block), key_positions.reshape(-1, block)))

    def unblocked(x):  # [n, b, h, block, d] -> [b, h, n * block, d]
        return x.transpose(1, 2, 0, 3, 4).reshape(b, kv_heads, -1, x.shape[-1])

    return (grad_query.reshape(query.shape).astype(query.dtype), unblocked(grad_key),
            unblocked(grad_value), None, None)


blockwise_attention.defvjp(_blockwise_vjp_forward, _blockwise_vjp_backward)
