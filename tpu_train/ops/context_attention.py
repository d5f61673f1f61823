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
back), keeps its own queries, and masks by the tokens' true positions. The per-shard attention
is the ordinary lowering at the shard's length: ``[b, h, S / N, S]`` scores.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy
from jax import lax
from jax.sharding import PartitionSpec

__all__ = ["SequenceSplit", "active", "applies", "attention", "lowering_key", "sequence_split",
           "zigzag_positions"]


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """Sequences of ``seq_len`` tokens split over ``axis`` of ``mesh`` (zig-zag); the batch over
    ``batch_axes`` and heads over ``head_axis`` where they divide."""

    mesh: Any
    seq_len: int
    axis: str = "context"
    batch_axes: tuple[str, ...] = ("data", "fsdp")
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


def attention(query, key, value, scale, local_attention: Callable):
    """``(out, logsumexp)`` of causal attention over the active split's sequence.

    ``local_attention(q, k, v, mask, is_causal, scale)`` is the one-device attention (with
    its own backward); it runs per shard on ``[b, h, S / N, d]`` queries against the
    gathered ``[b, h_kv, S, d]`` keys and values.
    """
    split = _SPLIT.get()
    mesh, axis, shards = split.mesh, split.axis, split.shards
    positions = jnp.asarray(zigzag_positions(split.seq_len, shards), jnp.int32)
    local_len = split.seq_len // shards
    batch = _divisible_axes(mesh, split.batch_axes, query.shape[0])
    heads = split.head_axis if (split.head_axis in mesh.shape and
                                query.shape[1] % mesh.shape[split.head_axis] == 0 and
                                key.shape[1] % mesh.shape[split.head_axis] == 0) else None
    spec = PartitionSpec(batch, heads, axis, None)

    def per_shard(q, k, v):
        keys = lax.all_gather(k, axis, axis=2, tiled=True)
        values = lax.all_gather(v, axis, axis=2, tiled=True)
        mine = lax.dynamic_slice_in_dim(positions, lax.axis_index(axis) * local_len, local_len)
        mask = mine[:, None] >= positions[None, :]  # [S / N, S], True where a key is visible
        return local_attention(q, keys, values, mask, False, scale)

    return jax.shard_map(per_shard, mesh=mesh, in_specs=(spec, spec, spec),
                         out_specs=(spec, PartitionSpec(batch, heads, axis)),
                         check_vma=False)(query, key, value)
