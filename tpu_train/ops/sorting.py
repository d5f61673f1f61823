"""Order statistics and searches: ``cummax``/``cummin``, ``median``/``nanmedian``, ``kthvalue``,
``mode``, ``searchsorted``/``bucketize``, ``histc``, ``equal``, ``unique`` and
``unique_consecutive``.

PyTorch conventions kept here: NaN sorts after every number; ``median`` is the *lower* median
and is NaN (at the first NaN's index) when a NaN is present, ``nanmedian`` skips NaNs;
``cummax``/``cummin`` report the *last* index of the running extreme and let a NaN win (it
propagates); ``mode`` picks the smallest of the most frequent values and its last index.
Indices are int64 (int32 storage).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpu_train.ops.conversion import DEFAULT_INT
from tpu_train.ops.registry import aten, get_lowering, lowers


def _lowers_free(*ops):
    """``lowers`` for the overloads no other family lowered yet (those are left alone)."""
    free = [op for op in ops if get_lowering(op) is None]
    return lowers(*free) if free else (lambda fn: fn)


def _dim(dim, ndim):
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(f"Dimension out of range (expected to be in range of "
                         f"[{-rank}, {rank - 1}], but got {dim})")
    return dim % rank


def _isnan(x):
    return jnp.isnan(x) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.zeros(x.shape, bool)


# ----------------------------------------------------------------------------- cummax / cummin


def _cumulative_extreme(self, dim, later_wins):
    if self.ndim == 0:
        return self, jnp.zeros((), DEFAULT_INT)
    axis = _dim(dim, self.ndim)
    if self.shape[axis] == 0:
        return self, jnp.zeros(self.shape, DEFAULT_INT)
    shape = [1] * self.ndim
    shape[axis] = self.shape[axis]
    index = jnp.broadcast_to(jnp.arange(self.shape[axis], dtype=DEFAULT_INT).reshape(shape),
                             self.shape)

    def combine(a, b):
        (av, ai), (bv, bi) = a, b
        take_b = _isnan(bv) | (~_isnan(av) & later_wins(bv, av))
        return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)

    return lax.associative_scan(combine, (self, index), axis=axis)


@_lowers_free(aten.cummax.default)
def cummax(self, dim):
    """Running maximum along ``dim`` and the last index where it was reached."""
    return _cumulative_extreme(self, dim, lambda b, a: b >= a)


@_lowers_free(aten.cummin.default)
def cummin(self, dim):
    """Running minimum along ``dim`` and the last index where it was reached."""
    return _cumulative_extreme(self, dim, lambda b, a: b <= a)


# ----------------------------------------------------------------------------- order statistics


def _sorted_along(self, axis):
    """Stable ascending sort along ``axis`` with NaN last: (values, original indices)."""
    order = jnp.argsort(self, axis=axis, stable=True)
    return jnp.take_along_axis(self, order, axis=axis), order.astype(DEFAULT_INT)


def _select(values, order, position, axis, keepdim):
    """Pick ``position`` (an array broadcastable to the reduced shape) along ``axis``."""
    position = jnp.expand_dims(position, axis)
    value = jnp.take_along_axis(values, position, axis=axis)
    index = jnp.take_along_axis(order, position, axis=axis)
    if not keepdim:
        value, index = jnp.squeeze(value, axis), jnp.squeeze(index, axis)
    return value, index


def _median_dim(self, dim, keepdim, ignore_nan):
    if self.ndim == 0:
        return self, jnp.zeros((), DEFAULT_INT)
    axis = _dim(dim, self.ndim)
    if self.shape[axis] == 0:
        raise IndexError("median(): Expected reduction dim to have non-zero size")
    values, order = _sorted_along(self, axis)
    nans = jnp.sum(_isnan(self), axis=axis)
    size = self.shape[axis]
    if ignore_nan:
        # all-NaN rows: position 0 holds a NaN, which is the answer
        position = jnp.maximum((size - nans - 1) // 2, 0)
    else:
        # a NaN row answers NaN at its first NaN (the first one after the numbers)
        position = jnp.where(nans > 0, size - nans, (size - 1) // 2)
    return _select(values, order, position, axis, keepdim)


def _median_all(self, ignore_nan):
    flat = self.reshape(-1)
    if flat.size == 0:
        return jnp.full((), jnp.nan, self.dtype)
    return _median_dim(flat, 0, False, ignore_nan)[0]


@_lowers_free(aten.median.default)
def median(self):
    """Lower median of all elements; NaN if any element is NaN."""
    return _median_all(self, ignore_nan=False)


@_lowers_free(aten.median.dim)
def median_dim(self, dim, keepdim=False):
    return _median_dim(self, dim, keepdim, ignore_nan=False)


@_lowers_free(aten.nanmedian.default)
def nanmedian(self):
    """Lower median of the non-NaN elements (NaN if there are none)."""
    return _median_all(self, ignore_nan=True)


@_lowers_free(aten.nanmedian.dim)
def nanmedian_dim(self, dim, keepdim=False):
    return _median_dim(self, dim, keepdim, ignore_nan=True)


@_lowers_free(aten.kthvalue.default)
def kthvalue(self, k, dim=-1, keepdim=False):
    """The ``k``-th smallest value (1-based, NaN largest) along ``dim`` and its index."""
    if self.ndim == 0:
        if k != 1:
            raise IndexError(f"kthvalue(): selected number k out of range for dimension 0")
        return self, jnp.zeros((), DEFAULT_INT)
    axis = _dim(dim, self.ndim)
    if not 1 <= k <= self.shape[axis]:
        raise IndexError(f"kthvalue(): selected number k out of range for dimension {dim}")
    values, order = _sorted_along(self, axis)
    position = jnp.full(values.shape[:axis] + values.shape[axis + 1:], k - 1, DEFAULT_INT)
    return _select(values, order, position, axis, keepdim)


@_lowers_free(aten.mode.default)
def mode(self, dim=-1, keepdim=False):
    """Most frequent value along ``dim`` (the smallest among ties) and its last index."""
    if self.ndim == 0:
        return self, jnp.zeros((), DEFAULT_INT)
    axis = _dim(dim, self.ndim)
    x = jnp.moveaxis(self, axis, -1)
    n = x.shape[-1]
    same = (x[..., :, None] == x[..., None, :]) | (_isnan(x)[..., :, None] & _isnan(x)[..., None, :])
    counts = jnp.sum(same, axis=-1)
    best = jnp.max(counts, axis=-1, keepdims=True)
    candidates = jnp.where(counts == best, x, jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact)
                           else jnp.iinfo(x.dtype).max if x.dtype != jnp.bool_ else True)
    # the smallest candidate, NaN last: sort the candidates and take the first
    value = jnp.sort(candidates, axis=-1)[..., :1]
    match = (x == value) | (_isnan(x) & _isnan(value)) if jnp.issubdtype(x.dtype, jnp.inexact) \
        else (x == value)
    match = match & (counts == best)
    index = (n - 1 - jnp.argmax(match[..., ::-1], axis=-1)).astype(DEFAULT_INT)
    value = value[..., 0]
    if keepdim:
        value, index = jnp.expand_dims(value, axis), jnp.expand_dims(index, axis)
    return value, index


# ----------------------------------------------------------------------------- searches


def _search(sorted_sequence, values, right, side, sorter, out_int32):
    if side is not None:
        right = side == "right"
    dtype = jnp.int32 if out_int32 else DEFAULT_INT
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter.astype(jnp.int32), axis=-1)
    method = "right" if right else "left"
    if sorted_sequence.ndim <= 1:
        return jnp.searchsorted(sorted_sequence, values, side=method).astype(dtype)
    lead = sorted_sequence.shape[:-1]
    if values.shape[:-1] != lead:
        raise RuntimeError("torch.searchsorted(): boundaries tensor should be 1 dimension or the "
                           "first N-1 dimensions of boundaries tensor and input value tensor must "
                           "match")
    seq = sorted_sequence.reshape(-1, sorted_sequence.shape[-1])
    vals = values.reshape(-1, values.shape[-1])
    out = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=method))(seq, vals)
    return out.reshape(values.shape).astype(dtype)


def _common(a, b):
    dtype = jnp.promote_types(a.dtype, b.dtype)
    return a.astype(dtype), b.astype(dtype)


@_lowers_free(aten.searchsorted.Tensor)
def searchsorted(sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None):
    """Insertion indices of ``self`` into the last dim of ``sorted_sequence``."""
    sorted_sequence, self = _common(sorted_sequence, self)
    return _search(sorted_sequence, self, right, side, sorter, out_int32)


@_lowers_free(aten.searchsorted.Scalar)
def searchsorted_scalar(sorted_sequence, self, *, out_int32=False, right=False, side=None,
                        sorter=None):
    if sorted_sequence.ndim != 1:
        raise RuntimeError("torch.searchsorted(): input value can be a scalar only when "
                           "boundaries tensor dimension is 1")
    sorted_sequence, value = _common(sorted_sequence, jnp.asarray(self))
    return _search(sorted_sequence, value, right, side, sorter, out_int32)


@_lowers_free(aten.bucketize.Tensor)
def bucketize(self, boundaries, *, out_int32=False, right=False):
    """Bucket index of each element of ``self`` among the 1-D ``boundaries``."""
    boundaries, self = _common(boundaries, self)
    return _search(boundaries, self, right, None, None, out_int32)


@_lowers_free(aten.bucketize.Scalar)
def bucketize_scalar(self, boundaries, *, out_int32=False, right=False):
    boundaries, value = _common(boundaries, jnp.asarray(self))
    return _search(boundaries, value, right, None, None, out_int32)


@_lowers_free(aten.histc.default)
def histc(self, bins=100, min=0, max=0):  # noqa: A002  (the schema's names)
    """Histogram of ``bins`` equal bins over ``[min, max]`` (the data's range when equal).

    Elements outside the range (and NaN) are ignored; ``max`` itself falls in the last bin.
    """
    x = self.reshape(-1).astype(jnp.float32)
    low, high = jnp.asarray(min, jnp.float32), jnp.asarray(max, jnp.float32)
    if x.size:
        data_low, data_high = jnp.min(x), jnp.max(x)
    else:
        data_low, data_high = jnp.zeros(()), jnp.zeros(())
    auto = low == high
    low, high = jnp.where(auto, data_low, low), jnp.where(auto, data_high, high)
    degenerate = low == high
    low, high = jnp.where(degenerate, low - 1, low), jnp.where(degenerate, high + 1, high)
    inside = (x >= low) & (x <= high)
    position = jnp.floor((x - low) * bins / (high - low))
    position = jnp.clip(jnp.where(inside, position, 0), 0, bins - 1).astype(jnp.int32)
    counts = jnp.zeros((bins,), jnp.float32).at[position].add(inside.astype(jnp.float32))
    return counts.astype(self.dtype)


@_lowers_free(aten.equal.default)
def equal(self, other):
    """True iff both have the same shape and elements (a 0-dim bool; NaN is never equal)."""
    if self.shape != other.shape:
        return jnp.asarray(False)
    return jnp.all(self == other)


# ---------------------------------------------------------------------------------------------
# unique: the output length depends on the values, so these run eagerly on host values (like
# ``masked_select``), not inside a compiled step.


def _host(array, op):
    try:
        return np.asarray(array)
    except Exception as error:  # a tracer
        raise NotImplementedError(
            f"{op} has a data-dependent output shape: it works eagerly, not inside a compiled "
            "step") from error


def _unique_outputs(values, inverse, counts, shape, return_inverse, return_counts):
    empty = jnp.zeros((0,), jnp.int32)
    return (jnp.asarray(values),
            jnp.asarray(inverse.reshape(shape), jnp.int32) if return_inverse else empty,
            jnp.asarray(counts, jnp.int32) if return_counts else empty)


@lowers(aten._unique2.default)
def unique2(self, sorted=True, return_inverse=False, return_counts=False):
    """Sorted distinct elements (NaNs stay distinct, as in PyTorch), inverse indices, counts."""
    x = _host(self, "unique").reshape(-1)
    values, inverse, counts = np.unique(x, return_inverse=True, return_counts=True,
                                        equal_nan=False)
    return _unique_outputs(values, inverse, counts, self.shape, return_inverse, return_counts)


@lowers(aten.unique_consecutive.default)
def unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    """One element (or slice along ``dim``) per run of equal consecutive ones."""
    x = _host(self, "unique_consecutive")
    moved = x.reshape(-1, 1) if dim is None else np.moveaxis(x, dim, 0)
    rows = moved.reshape(moved.shape[0], -1)
    if rows.shape[0] == 0:
        starts = np.zeros((0,), bool)
    else:
        starts = np.concatenate([[True], np.any(rows[1:] != rows[:-1], axis=1)])
    keep = np.flatnonzero(starts)
    inverse = np.cumsum(starts) - 1
    counts = np.diff(np.append(keep, rows.shape[0]))
    values = moved[keep]
    values = values.reshape(-1) if dim is None else np.moveaxis(values, 0, dim)
    if dim is None:
        return _unique_outputs(values, inverse, counts, self.shape, return_inverse,
                               return_counts)
    # Along a dim CPU PyTorch returns the inverse and the counts whatever the flags say.
    return _unique_outputs(values, inverse, counts, (self.shape[dim],), True, True)
