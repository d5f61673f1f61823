"""``segment_reduce`` (``torch._segment_reduce``) and its backward.

Along ``axis``, consecutive segments of ``data`` given by ``lengths`` (``data.shape[:axis] +
(S,)``) or ``offsets`` (``... + (S + 1,)``) are reduced with ``sum``, ``mean``, ``max``,
``min`` or ``prod``. ``initial`` joins every segment as one more operand (for ``mean`` it is
added to the sum, the count stays the segment's length); an empty segment gives ``initial``,
or without one 0, NaN, -inf, inf, 1 respectively. Elements past the last offset belong to no
segment. Each row of the leading dims gets its own segment ids, all reduced by one
``jax.ops.segment_*`` call; the backward is the pullback of this forward (max/min ties share
the gradient equally, as ATen's backward does).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tpu_train.ops.conversion import opmath_dtype
from tpu_train.ops.registry import aten, lowers

_SEGMENT_OPS = {"sum": jax.ops.segment_sum, "mean": jax.ops.segment_sum,
                "max": jax.ops.segment_max, "min": jax.ops.segment_min,
                "prod": jax.ops.segment_prod}


def _offsets(lengths, offsets, axis, data):
    """Offsets as ``(rows, S + 1)`` int32, one row per index of ``data.shape[:axis]``."""
    rows = math.prod(data.shape[:axis])
    if offsets is None:
        lengths = lengths.reshape(rows, -1).astype(jnp.int32)
        zero = jnp.zeros((rows, 1), jnp.int32)
        return jnp.concatenate([zero, jnp.cumsum(lengths, axis=1)], axis=1)
    return offsets.reshape(rows, -1).astype(jnp.int32)


def _segment_ids(data, lengths, offsets, axis):
    """``(edges, ids)``: ``ids`` ``(rows, n)`` numbers the segments of all rows in turn;
    elements in no segment get ``rows * S``."""
    edges = _offsets(lengths, offsets, axis, data)
    rows, segments = edges.shape[0], edges.shape[1] - 1
    position = jnp.arange(data.shape[axis], dtype=jnp.int32)
    seg = jax.vmap(lambda e: jnp.searchsorted(e[:-1], position, side="right") - 1)(edges)
    valid = (seg >= 0) & (position[None, :] < edges[:, -1:])
    return edges, jnp.where(valid, seg + segments * jnp.arange(rows)[:, None], rows * segments)


def _segment_reduce(data, reduce, lengths, offsets, axis, initial):
    axis = axis % data.ndim
    edges, ids = _segment_ids(data, lengths, offsets, axis)
    rows, segments = edges.shape[0], edges.shape[1] - 1
    n = data.shape[axis]
    rest = data.shape[axis + 1:]
    compute = opmath_dtype(data.dtype)
    values = data.astype(compute).reshape((rows * n,) + rest)
    out = _SEGMENT_OPS[reduce](values, ids.reshape(-1), rows * segments + 1)[:-1]
    out = out.reshape((rows, segments) + rest)
    count = jnp.diff(edges, axis=1).astype(compute).reshape((rows, segments) + (1,) * len(rest))
    if initial is not None:
        init = jnp.asarray(initial, compute)
        out = {"sum": lambda: out + init, "mean": lambda: out + init,
               "max": lambda: jnp.maximum(out, init), "min": lambda: jnp.minimum(out, init),
               "prod": lambda: out * init}[reduce]()
    if reduce == "mean":
        out = jnp.where(count > 0, out / jnp.where(count > 0, count, 1),
                        out if initial is not None else jnp.nan)
    out = out.reshape(data.shape[:axis] + (segments,) + rest)
    return out.astype(data.dtype)


@lowers(aten.segment_reduce.default)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0,
                   unsafe=False, initial=None):
    """One reduction per segment along ``axis`` (``indices`` is unused, as in ATen)."""
    return _segment_reduce(data, reduce, lengths, offsets, axis, initial)


@lowers(aten._segment_reduce_backward.default)
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0,
                            initial=None):
    """The gradient with respect to ``data``."""
    if reduce == "prod":
        return _prod_backward(grad, data, lengths, offsets, axis % data.ndim, initial)
    if reduce in ("max", "min"):
        return _extremal_backward(grad, output, data, lengths, offsets, axis % data.ndim)
    _, pullback = jax.vjp(
        lambda d: _segment_reduce(d, reduce, lengths, offsets, axis, initial), data)
    return pullback(grad.astype(data.dtype))[0]


def _per_element(segment_values, ids, data, axis):
    """``(..., S, rest)`` segment values at each element of ``data`` (0 outside segments)."""
    compute = opmath_dtype(data.dtype)
    flat = segment_values.astype(compute).reshape((-1,) + data.shape[axis + 1:])
    flat = jnp.concatenate([flat, jnp.zeros((1,) + flat.shape[1:], compute)])
    return flat[ids.reshape(-1)].reshape(data.shape)


def _extremal_backward(grad, output, data, lengths, offsets, axis):
    compute = opmath_dtype(data.dtype)
    x = data.astype(compute)
    _, ids = _segment_ids(data, lengths, offsets, axis)
    hit = jnp.isnan(x) | (x == _per_element(output, ids, data, axis))
    counter = _segment_reduce(hit.astype(compute), "sum", lengths, offsets, axis, None)
    g = jnp.where(hit, _per_element(grad, ids, data, axis), 0)
    shared = _per_element(counter, ids, data, axis)
    g = jnp.where((shared >= 2) & (g > 0), g / jnp.maximum(shared, 1), g)
    return g.astype(data.dtype)


def _prod_backward(grad, data, lengths, offsets, axis, initial):
    compute = opmath_dtype(data.dtype)
    x = data.astype(compute)
    zero = x == 0
    nonzero_prod = _segment_reduce(jnp.where(zero, 1, x), "prod", lengths, offsets, axis, initial)
    zeros = _segment_reduce(zero.astype(compute), "sum", lengths, offsets, axis, None)
    _, ids = _segment_ids(data, lengths, offsets, axis)
    g, p, z = (_per_element(v, ids, data, axis) for v in (grad, nonzero_prod, zeros))
    safe = jnp.where(zero, 1, x)
    out = jnp.where(zero, jnp.where(z == 1, g * p, 0), jnp.where(z == 0, g * p / safe, 0))
    return out.astype(data.dtype)
