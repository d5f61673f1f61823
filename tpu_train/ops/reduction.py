"""Reductions, scans, sorting and ``topk``.

PyTorch conventions kept here: ``dim=None`` and ``dim=[]`` reduce every dim for the ops whose
schema says so; integer and bool sums/products/cumsums produce int64 (int32 storage); bf16/f16
reductions accumulate in float32; ``max.dim``/``argmax`` return the first index of the extreme
value and treat NaN as the largest value; ``sort`` is stable and orders NaN after +inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tpu_train.ops.conversion import (DEFAULT_INT, cast_scalar, float_result_dtype,
                                      is_floating, is_integral, opmath_dtype, torch_default_dtype)
from tpu_train.ops.registry import aten, lowers


def reduction_axes(dim, ndim: int) -> tuple[int, ...]:
    """Normalise a ``dim`` argument; ``None`` and ``[]`` mean every dim (a 0-dim tensor has none).

    A 0-dim tensor accepts dim 0 / -1 as PyTorch does, reducing over nothing.
    """
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims:
        return tuple(range(ndim))
    rank = max(ndim, 1)
    axes = []
    for d in dims:
        if not -rank <= d < rank:
            raise IndexError(f"Dimension out of range (expected to be in range of "
                             f"[{-rank}, {rank - 1}], but got {d})")
        axes.append(d % rank)
    if len(set(axes)) != len(axes):
        raise RuntimeError(f"dim {dims} appears multiple times in the list of dims")
    return tuple(a for a in axes if a < ndim)


def _single_axis(dim, ndim: int):
    """One normalised dim, or ``None`` for a 0-dim tensor."""
    axes = reduction_axes([dim], ndim)
    return axes[0] if axes else None


def _accumulate_dtype(self, dtype, integer_result=DEFAULT_INT):
    """``(result, accumulate)`` dtypes: integers widen to int64, bf16/f16 accumulate in f32."""
    if dtype is not None:
        result = torch_default_dtype(dtype, None)
    elif is_integral(self.dtype, include_bool=True):
        result = jnp.dtype(integer_result)
    else:
        result = jnp.dtype(self.dtype)
    return result, opmath_dtype(result)


# ----------------------------------------------------------------------------- sum / mean / prod


def _sum(self, dim, keepdim, dtype):
    result, accumulate = _accumulate_dtype(self, dtype)
    axes = reduction_axes(dim, self.ndim)
    return jnp.sum(self.astype(accumulate), axis=axes, keepdims=keepdim).astype(result)


@lowers(aten.sum.default)
def sum_(self, *, dtype=None):
    return _sum(self, None, False, dtype)


@lowers(aten.sum.dim_IntList)
def sum_dim(self, dim, keepdim=False, *, dtype=None):
    return _sum(self, dim, keepdim, dtype)


@lowers(aten.nansum.default)
def nansum(self, dim=None, keepdim=False, *, dtype=None):
    cleaned = jnp.where(jnp.isnan(self), 0, self) if is_floating(self.dtype) else self
    return _sum(cleaned, dim, keepdim, dtype)


def _mean(self, dim, keepdim, dtype):
    result = torch_default_dtype(dtype, self.dtype)
    if not is_floating(result):
        raise RuntimeError(f"mean(): could not infer output dtype; got {result}: input must be "
                           "floating point or complex, or pass a floating dtype")
    accumulate = opmath_dtype(result)
    axes = reduction_axes(dim, self.ndim)
    return jnp.mean(self.astype(accumulate), axis=axes, keepdims=keepdim).astype(result)


@lowers(aten.mean.default)
def mean(self, *, dtype=None):
    return _mean(self, None, False, dtype)


@lowers(aten.mean.dim)
def mean_dim(self, dim, keepdim=False, *, dtype=None):
    return _mean(self, dim, keepdim, dtype)


def _prod(self, dim, keepdim, dtype):
    result, accumulate = _accumulate_dtype(self, dtype)
    axes = reduction_axes(dim, self.ndim)
    return jnp.prod(self.astype(accumulate), axis=axes, keepdims=keepdim).astype(result)


@lowers(aten.prod.default)
def prod(self, *, dtype=None):
    return _prod(self, None, False, dtype)


@lowers(aten.prod.dim_int)
def prod_dim(self, dim, keepdim=False, *, dtype=None):
    return _prod(self, [dim], keepdim, dtype)


# ----------------------------------------------------------------------------- extremes


def _check_nonempty(self, axes, name):
    if any(self.shape[a] == 0 for a in axes) or (not axes and self.size == 0):
        raise IndexError(f"{name}(): Expected reduction dim to have non-zero size")


@lowers(aten.amax.default)
def amax(self, dim=(), keepdim=False):
    axes = reduction_axes(dim, self.ndim)
    _check_nonempty(self, axes, "amax")
    return jnp.max(self, axis=axes, keepdims=keepdim)


@lowers(aten.amin.default)
def amin(self, dim=(), keepdim=False):
    axes = reduction_axes(dim, self.ndim)
    _check_nonempty(self, axes, "amin")
    return jnp.min(self, axis=axes, keepdims=keepdim)


@lowers(aten.max.default)
def max_(self):
    return amax(self)


@lowers(aten.min.default)
def min_(self):
    return amin(self)


@lowers(aten.aminmax.default)
def aminmax(self, *, dim=None, keepdim=False):
    return amin(self, dim if dim is not None else (), keepdim), \
        amax(self, dim if dim is not None else (), keepdim)


def _arg_extreme(self, dim, keepdim, largest: bool):
    """Index of the first max/min along ``dim`` (flattened when ``dim`` is None); NaN wins."""
    name = "argmax" if largest else "argmin"
    values = self.astype(jnp.int32) if self.dtype == jnp.bool_ else self
    if dim is None:
        if self.size == 0:
            raise IndexError(f"{name}(): Expected reduction dim to be specified for "
                             "input.numel() == 0.")
        values, axis = jnp.reshape(values, (-1,)), 0
    else:
        axis = _single_axis(dim, self.ndim)
        if axis is None:
            return jnp.zeros(self.shape, DEFAULT_INT)
        if self.shape[axis] == 0:
            raise IndexError(f"{name}(): Expected reduction dim {dim} to have non-zero size.")
    # jnp.argmax/argmin return the first extreme and treat NaN as the extreme, as PyTorch.
    index = jnp.argmax(values, axis=axis) if largest else jnp.argmin(values, axis=axis)
    index = index.astype(DEFAULT_INT)
    if not keepdim:
        return index
    return jnp.reshape(index, (1,) * self.ndim) if dim is None else jnp.expand_dims(index, axis)


@lowers(aten.argmax.default)
def argmax(self, dim=None, keepdim=False):
    return _arg_extreme(self, dim, keepdim, largest=True)


@lowers(aten.argmin.default)
def argmin(self, dim=None, keepdim=False):
    return _arg_extreme(self, dim, keepdim, largest=False)


def _extreme_dim(self, dim, keepdim, largest):
    axis = _single_axis(dim, self.ndim)
    if axis is None:
        return self, jnp.zeros(self.shape, DEFAULT_INT)
    index = _arg_extreme(self, dim, True, largest)
    values = jnp.take_along_axis(self, index, axis=axis)
    if not keepdim:
        values, index = jnp.squeeze(values, axis), jnp.squeeze(index, axis)
    return values, index


@lowers(aten.max.dim)
def max_dim(self, dim, keepdim=False):
    return _extreme_dim(self, dim, keepdim, largest=True)


@lowers(aten.min.dim)
def min_dim(self, dim, keepdim=False):
    return _extreme_dim(self, dim, keepdim, largest=False)


# ----------------------------------------------------------------------------- any / all / count


@lowers(aten.any.default)
def any_(self):
    return jnp.any(self != 0)


def _logical_axes(dim, ndim):
    # Unlike sum, any/all.dims read ``dim=[]`` literally: reduce over no dim at all.
    if dim is not None and not isinstance(dim, int) and len(dim) == 0:
        return ()
    return reduction_axes(dim, ndim)


@lowers(aten.any.dim, aten.any.dims)
def any_dim(self, dim=None, keepdim=False):
    return jnp.any(self != 0, axis=_logical_axes(dim, self.ndim), keepdims=keepdim)


@lowers(aten.all.default)
def all_(self):
    return jnp.all(self != 0)


@lowers(aten.all.dim, aten.all.dims)
def all_dim(self, dim=None, keepdim=False):
    return jnp.all(self != 0, axis=_logical_axes(dim, self.ndim), keepdims=keepdim)


@lowers(aten.count_nonzero.default)
def count_nonzero(self, dim=None):
    return jnp.sum(self != 0, axis=reduction_axes(dim, self.ndim), dtype=DEFAULT_INT)


@lowers(aten.count_nonzero.dim_IntList)
def count_nonzero_dims(self, dim):
    return jnp.sum(self != 0, axis=reduction_axes(dim, self.ndim), dtype=DEFAULT_INT)


# ----------------------------------------------------------------------------- var / std


def _var(self, dim, correction, keepdim):
    result = float_result_dtype(self.dtype)
    x = self.astype(opmath_dtype(result))
    axes = reduction_axes(dim, self.ndim)
    count = 1
    for a in axes:
        count *= self.shape[a]
    correction = 1 if correction is None else correction
    mean = jnp.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    # Divide by max(0, N - correction): PyTorch gives inf/nan there, not an error.
    divisor = jnp.maximum(count - cast_scalar(correction, x.dtype), 0)
    var = jnp.sum(centered * centered, axis=axes, keepdims=keepdim) / divisor
    mean = mean if keepdim else jnp.squeeze(mean, axes)
    return var, mean, result


@lowers(aten.var.correction)
def var_correction(self, dim=None, *, correction=None, keepdim=False):
    var, _, result = _var(self, dim, correction, keepdim)
    return var.astype(result)


@lowers(aten.var.dim)
def var_dim(self, dim, unbiased=True, keepdim=False):
    var, _, result = _var(self, dim, 1 if unbiased else 0, keepdim)
    return var.astype(result)


@lowers(aten.var.default)
def var_default(self, unbiased=True):
    return var_dim(self, None, unbiased)


@lowers(aten.std.correction)
def std_correction(self, dim=None, *, correction=None, keepdim=False):
    var, _, result = _var(self, dim, correction, keepdim)
    return jnp.sqrt(var).astype(result)


@lowers(aten.std.dim)
def std_dim(self, dim, unbiased=True, keepdim=False):
    var, _, result = _var(self, dim, 1 if unbiased else 0, keepdim)
    return jnp.sqrt(var).astype(result)


@lowers(aten.std.default)
def std_default(self, unbiased=True):
    return std_dim(self, None, unbiased)


@lowers(aten.var_mean.correction)
def var_mean(self, dim=None, *, correction=None, keepdim=False):
    var, mean, result = _var(self, dim, correction, keepdim)
    return var.astype(result), mean.astype(result)


@lowers(aten.std_mean.correction)
def std_mean(self, dim=None, *, correction=None, keepdim=False):
    var, mean, result = _var(self, dim, correction, keepdim)
    return jnp.sqrt(var).astype(result), mean.astype(result)


# ----------------------------------------------------------------------------- scans


def _scan(self, dim, dtype, scan):
    result, accumulate = _accumulate_dtype(self, dtype)
    axis = _single_axis(dim, self.ndim)
    x = self.astype(accumulate)
    if axis is None:
        return x.astype(result)
    return scan(x, axis).astype(result)


@lowers(aten.cumsum.default)
def cumsum(self, dim, *, dtype=None):
    return _scan(self, dim, dtype, lambda x, axis: jnp.cumsum(x, axis=axis))


@lowers(aten.cumprod.default)
def cumprod(self, dim, *, dtype=None):
    return _scan(self, dim, dtype, lambda x, axis: jnp.cumprod(x, axis=axis))


@lowers(aten.logcumsumexp.default)
def logcumsumexp(self, dim):
    result = float_result_dtype(self.dtype)
    x = self.astype(opmath_dtype(result))
    axis = _single_axis(dim, self.ndim)
    if axis is None or x.shape[axis] == 0:
        return x.astype(result)
    return lax.cumlogsumexp(x, axis=axis).astype(result)


@lowers(aten.logsumexp.default)
def logsumexp(self, dim, keepdim=False):
    result = float_result_dtype(self.dtype)
    x = self.astype(opmath_dtype(result))
    axes = reduction_axes(dim, self.ndim)
    return jax.nn.logsumexp(x, axis=axes, keepdims=keepdim).astype(result)


@jax.custom_jvp
def _sqrt_zero_gradient_at_zero(squares):
    """``sqrt``, whose JAX gradient is 0 (not NaN) where the sum of squares is 0: PyTorch's
    norm backward at a zero vector (``F.normalize`` of a zero row trains under torch). The
    forward stays one ``sqrt``: a program that only computes norms (the optimizer's gradient
    norms) gets no select around each one."""
    return jnp.sqrt(squares)


@_sqrt_zero_gradient_at_zero.defjvp
def _sqrt_zero_gradient_at_zero_jvp(primals, tangents):
    (squares,), (tangent,) = primals, tangents
    root = jnp.sqrt(squares)
    zero = squares == 0
    half_over_root = 0.5 / jnp.where(zero, jnp.ones((), root.dtype), root)
    return root, jnp.where(zero, jnp.zeros((), root.dtype), tangent * half_over_root)


# A full reduction of a long 1-D vector (a flat gradient buffer's norm) is summed as rows of
# this many elements: XLA's CPU backend splits a long 1-D reduction into one more stage (one
# more kernel to compile and run) than the same reduction over rows.
_NORM_ROW = 512


def _as_rows(x):
    """``x`` as ``[n / k, k]`` rows when it is a long 1-D vector (``k`` the largest power of
    two up to :data:`_NORM_ROW` dividing its length, at least 64), else ``x``."""
    if x.ndim != 1:
        return x
    row = _NORM_ROW
    while row >= 64 and x.shape[0] % row:
        row //= 2
    return x.reshape(-1, row) if row >= 64 and x.shape[0] >= 2 * row else x


@lowers(aten.linalg_vector_norm.default, static_floats=True)
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    result = torch_default_dtype(dtype, float_result_dtype(self.dtype))
    x = jnp.abs(self.astype(opmath_dtype(result)))
    axes = reduction_axes(dim, self.ndim)
    if isinstance(ord, (int, float)):
        if ord == float("inf"):
            return jnp.max(x, axis=axes, keepdims=keepdim).astype(result)
        if ord == float("-inf"):
            return jnp.min(x, axis=axes, keepdims=keepdim).astype(result)
        if ord == 0:
            return jnp.sum(x != 0, axis=axes, keepdims=keepdim).astype(result)
        if ord == 1:
            return jnp.sum(x, axis=axes, keepdims=keepdim).astype(result)
        if ord == 2:
            if dim is None and not keepdim:
                x, axes = _as_rows(x), None
            return _sqrt_zero_gradient_at_zero(jnp.sum(x * x, axis=axes,
                                                       keepdims=keepdim)).astype(result)
    ord = cast_scalar(ord, x.dtype)
    return (jnp.sum(x ** ord, axis=axes, keepdims=keepdim) ** (1 / ord)).astype(result)


# ----------------------------------------------------------------------------- sort / topk


def _sort_keys(x):
    """Keys that order like PyTorch: all NaNs last (after +inf), -0.0 equal to +0.0."""
    if is_floating(x.dtype):
        return jnp.where(jnp.isnan(x), jnp.nan, x + jnp.zeros((), x.dtype))
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    return x


def _stable_sort(self, axis, descending):
    """Stable sort along ``axis``: ``(values, int indices)``; equal keys keep their order."""
    keys = _sort_keys(self)
    index = lax.broadcasted_iota(DEFAULT_INT, self.shape, axis)
    if descending:
        # Sorting the reversed sequence ascending and reversing back keeps ties in order.
        keys, index = lax.rev(keys, (axis,)), lax.rev(index, (axis,))
    _, order = lax.sort_key_val(keys, index, dimension=axis, is_stable=True)
    if descending:
        order = lax.rev(order, (axis,))
    return jnp.take_along_axis(self, order, axis=axis), order


def _sort(self, dim, descending):
    axis = _single_axis(dim, self.ndim)
    if axis is None:
        return self, jnp.zeros(self.shape, DEFAULT_INT)
    return _stable_sort(self, axis, descending)


@lowers(aten.sort.default)
def sort(self, dim=-1, descending=False):
    return _sort(self, dim, descending)


@lowers(aten.sort.stable)
def sort_stable(self, *, stable=None, dim=-1, descending=False):
    return _sort(self, dim, descending)


@lowers(aten.argsort.default)
def argsort(self, dim=-1, descending=False):
    return _sort(self, dim, descending)[1]


@lowers(aten.argsort.stable)
def argsort_stable(self, *, stable, dim=-1, descending=False):
    return _sort(self, dim, descending)[1]


@lowers(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):
    axis = _single_axis(dim, self.ndim)
    if axis is None:
        if k > 1:
            raise RuntimeError("selected index k out of range")
        return self, jnp.zeros(self.shape, DEFAULT_INT)
    if not 0 <= k <= self.shape[axis]:
        raise RuntimeError("selected index k out of range")
    values, order = _stable_sort(self, axis, descending=largest)
    take = lambda a: lax.slice_in_dim(a, 0, k, axis=axis)  # noqa: E731
    return take(values), take(order)

