"""Strided reads (``as_strided``) and the functional writes through views.

Functionalization turns a write through a view into ``<view>_scatter(base, new_view_value)``:
the base with the viewed region replaced. Each scatter here is the exact inverse of its view
in :mod:`tpu_train.ops.shape`, built from static slices, pads and ``dynamic_update_slice`` at
static positions (XLA's in-place update), never from a generic scatter when the geometry is
regular.

``as_strided`` reads the *contiguous value* of its input as flat storage (value semantics:
the eager layer resolves real storage geometry itself). A strided geometry whose elements do
not overlap is peeled one dim at a time, outermost first: the flat row is fitted to
``size * stride`` elements, reshaped to ``(size, stride)``, and every row keeps only the
prefix the inner dims reach. Only overlapping geometries fall back to index gathers/scatters.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
from jax import lax

from tpu_train.ops.registry import aten, lowers
from tpu_train.ops.shape import diagonal_geometry, slice_bounds, wrap_dim


@dataclasses.dataclass(frozen=True)
class StridedPlan:
    """A non-overlapping strided view as nested (size, stride) levels.

    ``dims`` are the view's dims of size > 1 and nonzero stride, outermost first; level ``k``
    has ``sizes[k]``, ``strides[k]`` and ``reach[k]``: how many flat elements the levels inside
    it span (1 for the innermost).
    """

    dims: tuple[int, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    reach: tuple[int, ...]


def strided_plan(size: Sequence[int], stride: Sequence[int]) -> StridedPlan | None:
    """The level form of a strided view, or None when two of its elements share a position."""
    dims = sorted((d for d in range(len(size)) if size[d] > 1 and stride[d] != 0),
                  key=lambda d: -stride[d])
    reach, span = [], 1
    for d in reversed(dims):
        if stride[d] < span:
            return None
        reach.append(span)
        span += (size[d] - 1) * stride[d]
    return StridedPlan(tuple(dims), tuple(size[d] for d in dims), tuple(stride[d] for d in dims),
                       tuple(reversed(reach)))


def _fit_last(row, length: int):
    """``row`` with its last axis cut or zero-padded to ``length``."""
    have = row.shape[-1]
    if have >= length:
        return lax.slice_in_dim(row, 0, length, axis=row.ndim - 1)
    config = [(0, 0, 0)] * (row.ndim - 1) + [(0, length - have, 0)]
    return lax.pad(row, jnp.zeros((), row.dtype), config)


def _read_levels(row, plan: StridedPlan):
    for n, s, reach in zip(plan.sizes, plan.strides, plan.reach):
        grid = jnp.reshape(_fit_last(row, n * s), row.shape[:-1] + (n, s))
        row = lax.slice_in_dim(grid, 0, reach, axis=grid.ndim - 1)
    return lax.index_in_dim(row, 0, axis=row.ndim - 1, keepdims=False)


def _write_levels(row, src, levels):
    """``row`` (batch..., L) with the elements the remaining levels reach replaced by ``src``."""
    if not levels:
        return lax.dynamic_update_slice_in_dim(row, src[..., None], 0, axis=row.ndim - 1)
    (n, s, reach), rest = levels[0], levels[1:]
    batch, length = row.shape[:-1], row.shape[-1]
    grid = jnp.reshape(_fit_last(row, n * s), batch + (n, s))
    inner = lax.slice_in_dim(grid, 0, reach, axis=grid.ndim - 1)
    grid = lax.dynamic_update_slice_in_dim(grid, _write_levels(inner, src, rest), 0,
                                           axis=grid.ndim - 1)
    written = jnp.reshape(grid, batch + (n * s,))
    if n * s >= length:
        return lax.slice_in_dim(written, 0, length, axis=written.ndim - 1)
    return lax.dynamic_update_slice_in_dim(row, written, 0, axis=row.ndim - 1)


def strided_flat_index(size: Sequence[int], stride: Sequence[int], offset: int):
    """The flat position of every element of a strided view, as an int32 array of ``size``."""
    index = jnp.full(tuple(size), offset, jnp.int32)
    for d, (n, s) in enumerate(zip(size, stride)):
        if n > 1 and s:
            index = index + lax.broadcasted_iota(jnp.int32, tuple(size), d) * s
    return index


def _check_geometry(numel: int, size, stride, offset: int) -> None:
    if len(size) != len(stride):
        raise RuntimeError(f"mismatch in length of strides and shape: {len(size)} sizes, "
                           f"{len(stride)} strides")
    if any(s < 0 for s in stride):
        raise RuntimeError("as_strided: Negative strides are not supported at the moment")
    if offset < 0:
        raise RuntimeError(f"Tensor: invalid storage offset {offset}")
    if any(n == 0 for n in size):
        return
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= numel:
        raise RuntimeError(f"setStorage: sizes {list(size)}, strides {list(stride)}, storage "
                           f"offset {offset} are out of bounds for storage of {numel} elements")


def _geometry(self, size, stride, storage_offset):
    size, stride = tuple(int(n) for n in size), tuple(int(s) for s in stride)
    offset = int(storage_offset or 0)
    _check_geometry(self.size, size, stride, offset)
    return size, stride, offset


@lowers(aten.as_strided.default, aten.as_strided_copy.default)
def as_strided(self, size, stride, storage_offset=None):
    """A strided read of the contiguous value of ``self`` from ``storage_offset``.

    Non-overlapping geometries (every view torch's view ops make of a contiguous tensor, a
    diagonal included) become reshapes, static slices, a transpose and a broadcast;
    overlapping ones gather.
    """
    size, stride, offset = _geometry(self, size, stride, storage_offset)
    if any(n == 0 for n in size):
        return jnp.zeros(size, self.dtype)
    flat = jnp.reshape(self, (-1,))
    plan = strided_plan(size, stride)
    if plan is None:
        return jnp.take(flat, strided_flat_index(size, stride, offset))
    picked = _read_levels(lax.slice_in_dim(flat, offset, flat.size), plan)
    # The levels come out outermost first: put them back in view order, then restore the
    # size-1 and broadcast (stride 0) dims.
    order = sorted(range(len(plan.dims)), key=lambda i: plan.dims[i])
    if len(order) > 1:
        picked = jnp.transpose(picked, order)
    kept = set(plan.dims)
    unit = tuple(n if d in kept else 1 for d, n in enumerate(size))
    return jnp.broadcast_to(jnp.reshape(picked, unit), size)


@lowers(aten.as_strided_scatter.default)
def as_strided_scatter(self, src, size, stride, storage_offset=None):
    """``self`` with the strided view ``(size, stride, storage_offset)`` of it set to ``src``."""
    size, stride, offset = _geometry(self, size, stride, storage_offset)
    if tuple(src.shape) != size:
        raise RuntimeError(f"expected src to have a size equal to the slice of self. src size "
                           f"= {list(src.shape)}, slice size = {list(size)}")
    src = src.astype(self.dtype)
    if any(n == 0 for n in size):
        return self
    flat = jnp.reshape(self, (-1,))
    plan = strided_plan(size, stride)
    if plan is None or any(n > 1 and s == 0 for n, s in zip(size, stride)):
        # Several elements of the view share a position: torch leaves which write wins
        # unspecified, a scatter picks one.
        flat = flat.at[strided_flat_index(size, stride, offset)].set(src)
        return jnp.reshape(flat, self.shape)
    squeezed = jnp.reshape(src, tuple(size[d] for d in sorted(plan.dims)))
    ranked = sorted(plan.dims)
    leveled = jnp.transpose(squeezed, [ranked.index(d) for d in plan.dims])
    row = lax.slice_in_dim(flat, offset, flat.size)
    levels = list(zip(plan.sizes, plan.strides, plan.reach))
    flat = lax.dynamic_update_slice_in_dim(flat, _write_levels(row, leveled, levels), offset, 0)
    return jnp.reshape(flat, self.shape)


# --------------------------------------------------------------------------- view scatters


def _strided_placement(src, self, dim: int, start: int, step: int):
    """``src`` spread along ``dim`` of ``self``'s shape at ``start, start+step...`` with a mask.

    An interior pad places the elements; the same pad of a vector of ones says where they
    landed, so the write is one select instead of a scatter.
    """
    count, size = src.shape[dim], self.shape[dim]
    high = size - (start + (count - 1) * step + 1)
    config = [(0, 0, 0)] * self.ndim
    config[dim] = (start, high, step - 1)
    placed = lax.pad(src, jnp.zeros((), src.dtype), config)
    mask = lax.pad(jnp.ones((count,), jnp.bool_), False, [(start, high, step - 1)])
    mask_shape = [1] * self.ndim
    mask_shape[dim] = size
    return placed, jnp.reshape(mask, mask_shape)


def _check_src_shape(src, expected) -> None:
    if tuple(src.shape) != tuple(expected):
        raise RuntimeError(f"expected src to have a size equal to the slice of self. src size "
                           f"= {list(src.shape)}, slice size = {list(expected)}")


@lowers(aten.slice_scatter.default)
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    """``self`` with ``self[..., start:end:step]`` (on ``dim``) replaced by ``src``."""
    if self.ndim == 0:
        raise IndexError("slice() cannot be applied to a 0-dim tensor.")
    dim = wrap_dim(dim, self.ndim)
    start, end = slice_bounds(self.shape[dim], start, end, step)
    expected = list(self.shape)
    expected[dim] = len(range(start, end, step))
    _check_src_shape(src, expected)
    src = src.astype(self.dtype)
    if expected[dim] == 0:
        return self
    if step == 1:
        return lax.dynamic_update_slice_in_dim(self, src, start, axis=dim)
    placed, mask = _strided_placement(src, self, dim, start, step)
    return jnp.where(mask, placed, self)


@lowers(aten.slice_backward.default)
def slice_backward(grad_output, input_sizes, dim, start, end, step):
    """The gradient of ``x[..., start:end:step]`` (on ``dim``) for an ``x`` of ``input_sizes``:
    zeros with ``grad_output`` at the sliced positions, one pad (torch decomposes it into
    ``new_zeros`` and ``slice_scatter``: two ops and a fill)."""
    input_sizes = tuple(input_sizes)
    dim = wrap_dim(dim, len(input_sizes))
    size = input_sizes[dim]
    start, end = slice_bounds(size, start, end, step)
    expected = list(input_sizes)
    expected[dim] = len(range(start, end, step))
    _check_src_shape(grad_output, expected)
    if expected[dim] == 0:
        return jnp.zeros(input_sizes, grad_output.dtype)
    config = [(0, 0, 0)] * len(input_sizes)
    config[dim] = (start, size - (start + (expected[dim] - 1) * step + 1), step - 1)
    return lax.pad(grad_output, jnp.zeros((), grad_output.dtype), config)


@lowers(aten.select_scatter.default)
def select_scatter(self, src, dim, index):
    """``self`` with ``self.select(dim, index)`` replaced by ``src``."""
    dim = wrap_dim(dim, self.ndim)
    size = self.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"select_scatter(): index {index} out of range for tensor of size "
                         f"{tuple(self.shape)} at dimension {dim}")
    _check_src_shape(src, self.shape[:dim] + self.shape[dim + 1:])
    src = lax.expand_dims(src.astype(self.dtype), (dim,))
    return lax.dynamic_update_slice_in_dim(self, src, index % size, axis=dim)


@lowers(aten.diagonal_scatter.default)
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    """``self`` with ``self.diagonal(offset, dim1, dim2)`` replaced by ``src``."""
    d1, d2 = wrap_dim(dim1, self.ndim), wrap_dim(dim2, self.ndim)
    if d1 == d2:
        raise RuntimeError("diagonal dimensions cannot be identical")
    rows, cols = self.shape[d1], self.shape[d2]
    first, length = diagonal_geometry(rows, cols, offset)
    others = [d for d in range(self.ndim) if d not in (d1, d2)]
    batch = tuple(self.shape[d] for d in others)
    _check_src_shape(src, batch + (length,))
    if length == 0:
        return self
    perm = others + [d1, d2]
    flat = jnp.reshape(jnp.transpose(self, perm), batch + (rows * cols,))
    # Diagonal elements are cols + 1 apart in a flattened plane: a strided slice of it.
    placed, mask = _strided_placement(src.astype(self.dtype), flat, flat.ndim - 1, first,
                                      cols + 1)
    planes = jnp.reshape(jnp.where(mask, placed, flat), batch + (rows, cols))
    inverse = sorted(range(self.ndim), key=lambda i: perm[i])
    return jnp.transpose(planes, inverse)
