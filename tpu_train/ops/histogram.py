"""``histogram`` and ``histogramdd`` (``_histogramdd_bin_edges`` / ``_histogramdd_from_bin_cts``).

Bin edges: the given tensor, or ``bins + 1`` evenly spaced points over ``range`` or, without
one, over the data's min and max (per dimension for ``histogramdd``; NaNs ignored; ``[0, 1]``
for no data); a degenerate range ``[a, a]`` becomes ``[a - 0.5, a + 0.5]``, as ATen widens it. An element
falls in the bin whose edges enclose it (the last bin includes its right edge); elements
outside the outer edges, or NaN, count nowhere. Counts (or summed ``weight``) are in the
input's dtype, accumulated in float32 for 16-bit inputs; ``density`` divides by the total and
by each bin's width (its volume for ``histogramdd``).
"""

from __future__ import annotations

import jax.numpy as jnp

from tpu_train.ops.conversion import opmath_dtype
from tpu_train.ops.registry import aten, lowers


def _outer_edges(values, range_):
    """``(leftmost, rightmost)`` per column of ``values`` ``(N, D)``."""
    if range_ is not None:
        pairs = jnp.asarray(range_, values.dtype).reshape(-1, 2)
        low, high = pairs[:, 0], pairs[:, 1]
    elif values.shape[0] == 0:
        return (jnp.zeros((values.shape[1],), values.dtype),
                jnp.ones((values.shape[1],), values.dtype))
    else:
        low, high = jnp.nanmin(values, axis=0), jnp.nanmax(values, axis=0)
    same = low == high
    return jnp.where(same, low - 0.5, low), jnp.where(same, high + 0.5, high)


def _linear_edges(values, bins, range_):
    low, high = _outer_edges(values, range_)
    return [jnp.linspace(low[d], high[d], bins[d] + 1).astype(values.dtype)
            for d in range(values.shape[1])]


def _histogram(values, edges, weight, density, dtype):
    """Counts ``(bins_0, ..., bins_{D-1})`` of the rows of ``values`` ``(N, D)``."""
    compute = opmath_dtype(dtype)
    inside = jnp.ones(values.shape[:1], bool)
    flat = jnp.zeros(values.shape[:1], jnp.int32)
    shape = tuple(e.shape[0] - 1 for e in edges)
    for d, e in enumerate(edges):
        x = values[:, d]
        inside &= (x >= e[0]) & (x <= e[-1])
        position = jnp.clip(jnp.searchsorted(e, x, side="right") - 1, 0, shape[d] - 1)
        flat = flat * shape[d] + position.astype(jnp.int32)
    amount = jnp.ones(values.shape[:1], compute) if weight is None else weight.reshape(-1)
    amount = jnp.where(inside, amount.astype(compute), 0)
    size = 1
    for n in shape:
        size *= n
    hist = jnp.zeros((size,), compute).at[flat].add(amount).reshape(shape)
    if density:
        volume = jnp.ones(shape, compute)
        for d, e in enumerate(edges):
            width = jnp.diff(e.astype(compute))
            volume = volume * width.reshape((-1,) + (1,) * (len(shape) - d - 1))
        hist = hist / (jnp.sum(hist) * volume)
    return hist.astype(dtype)


@lowers(aten.histogram.bin_ct)
def histogram_bin_ct(self, bins=100, *, range=None, weight=None, density=False):
    """``(hist, bin_edges)`` over ``bins`` equal bins."""
    values = self.reshape(-1, 1)
    edges = _linear_edges(values, [bins], range)
    return _histogram(values, edges, weight, density, self.dtype), edges[0]


@lowers(aten.histogram.bins_tensor)
def histogram_bins_tensor(self, bins, *, weight=None, density=False):
    """``(hist, bin_edges)`` over the given (increasing) edges."""
    values = self.reshape(-1, 1)
    return _histogram(values, [bins], weight, density, self.dtype), bins


@lowers(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):
    """The edges of each of the last dim's ``D`` coordinates."""
    return _linear_edges(self.reshape(-1, self.shape[-1]), list(bins), range)


@lowers(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(self, bins, *, range=None, weight=None, density=False):
    """The ``D``-dimensional histogram over equal bins."""
    values = self.reshape(-1, self.shape[-1])
    edges = _linear_edges(values, list(bins), range)
    return _histogram(values, edges, weight, density, self.dtype)


@lowers(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    """The ``D``-dimensional histogram over the given edges."""
    values = self.reshape(-1, self.shape[-1])
    return _histogram(values, list(bins), weight, density, self.dtype)
