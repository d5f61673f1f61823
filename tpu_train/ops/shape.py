"""Lowerings of view ops (with value semantics) and of the ops that split, join or tile tensors.

Every view op here returns the *value* of the view: a reshape, transpose, static slice or
broadcast of its input. Eager mode keeps PyTorch's aliasing through storage geometry and only
uses these functions where a value is needed; the compiled step uses them directly, so each
one keeps an XLA-friendly form (slices stay slices, never gathers). The ``*_copy`` variants
that functionalization emits share the functions of their view ops.

``as_strided`` and the inverse writes that functionalization emits for writes through views
(``slice_scatter``, ``as_strided_scatter``...) live in :mod:`tpu_train.ops.scatter`.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from tpu_train.ops.dtypes import storage_dtype
from tpu_train.ops.registry import aten, lowers


def wrap_dim(dim: int, ndim: int) -> int:
    """A dim index in ``[0, ndim)``, wrapping negatives like torch (a 0-dim tensor has dim 0/-1)."""
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, "
                         f"{rank - 1}], but got {dim})")
    return dim % rank


def slice_bounds(size: int, start: int | None, end: int | None, step: int) -> tuple[int, int]:
    """torch's clamping of ``start:end`` on a dim of ``size`` (negatives wrap, then clamp)."""
    if step <= 0:
        raise ValueError("slice step must be positive")
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end


def slice_along(x, dim: int, start: int, end: int, step: int = 1):
    """A static strided slice of one dim (already clamped bounds)."""
    return lax.slice_in_dim(x, start, end, step, axis=dim)


def _infer_size(size: Sequence[int], numel: int) -> tuple[int, ...]:
    size = tuple(int(s) for s in size)
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size = tuple(numel // known if known and s == -1 else (0 if s == -1 else s)
                     for s in size)
    return size


# --------------------------------------------------------------------------- reshapes / aliases


@lowers(aten.view.default, aten._unsafe_view.default, aten.reshape.default,
        aten.view_copy.default)
def view(self, size):
    """A reshape of the value (torch's ``-1`` entry is inferred, as for ``view``)."""
    return jnp.reshape(self, _infer_size(size, self.size))


@lowers(aten._reshape_alias.default, aten._reshape_alias_copy.default)
def _reshape_alias(self, size, stride):
    """The value of a reshape alias: the strides only describe the eager storage layout."""
    return jnp.reshape(self, tuple(size))


@lowers(aten.view.dtype, aten.view_copy.dtype)
def view_dtype(self, dtype):
    """Reinterpret the bits as ``dtype``; the last dim grows or shrinks with the itemsize."""
    target = np.dtype(storage_dtype(dtype))
    source = np.dtype(self.dtype)
    if dtype.itemsize != target.itemsize:
        raise NotImplementedError(
            f"view(dtype={dtype}): its values are stored as {target}, so a bit view is not exact")
    if target.itemsize == source.itemsize:
        return lax.bitcast_convert_type(self, target)
    if self.ndim == 0:
        raise RuntimeError("self.dim() cannot be 0 to view a tensor as a dtype of another size")
    if target.itemsize < source.itemsize:
        # bitcast to a narrower type appends a dim of the size ratio: fold it into the last dim.
        out = lax.bitcast_convert_type(self, target)
        return jnp.reshape(out, self.shape[:-1] + (self.shape[-1] * out.shape[-1],))
    ratio = target.itemsize // source.itemsize
    if self.shape[-1] % ratio:
        raise RuntimeError("the last dim must be divisible by the itemsize ratio to view as "
                           f"{dtype}")
    grouped = jnp.reshape(self, self.shape[:-1] + (self.shape[-1] // ratio, ratio))
    return lax.bitcast_convert_type(grouped, target)


@lowers(aten.alias.default, aten.detach.default, aten.lift_fresh.default,
        aten.lift_fresh_copy.default, aten.alias_copy.default, aten.detach_copy.default)
def alias(self):
    """An alias has the value of its base."""
    return self


@lowers(aten.expand.default, aten.expand_copy.default)
def expand(self, size, *, implicit=False):
    """A broadcast: ``-1`` keeps an existing dim, new dims are prepended."""
    size = tuple(size)
    lead = len(size) - self.ndim
    if lead < 0:
        raise RuntimeError(f"expand: the number of sizes ({len(size)}) must be at least the "
                           f"number of dims ({self.ndim})")
    shape = tuple(self.shape[i - lead] if s == -1 and i >= lead else s
                  for i, s in enumerate(size))
    return jnp.broadcast_to(self, shape)


# --------------------------------------------------------------------------- dim permutations


@lowers(aten.permute.default, aten.permute_copy.default)
def permute(self, dims):
    """A transpose by ``dims`` (negative dims wrap)."""
    return jnp.transpose(self, tuple(wrap_dim(d, self.ndim) for d in dims))


@lowers(aten.transpose.int, aten.transpose_copy.int, aten.swapaxes.default)
def transpose(self, dim0, dim1):
    """Swap two dims (a no-op on 0-dim and 1-D tensors when the dims coincide)."""
    if self.ndim == 0:
        wrap_dim(dim0, 0), wrap_dim(dim1, 0)
        return self
    perm = list(range(self.ndim))
    d0, d1 = wrap_dim(dim0, self.ndim), wrap_dim(dim1, self.ndim)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return jnp.transpose(self, perm)


@lowers(aten.t.default, aten.t_copy.default)
def t(self):
    """Transpose of a matrix; 0-D and 1-D tensors are returned as is."""
    if self.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is "
                           f"{self.ndim}D")
    return self if self.ndim < 2 else jnp.transpose(self, (1, 0))


@lowers(aten.movedim.int, aten.movedim.intlist, aten.moveaxis.int, aten.moveaxis.intlist)
def movedim(self, source, destination):
    """Move dims ``source`` to positions ``destination``, the others keeping their order."""
    source = [source] if isinstance(source, int) else list(source)
    destination = [destination] if isinstance(destination, int) else list(destination)
    if len(source) != len(destination):
        raise RuntimeError("movedim: source and destination must have the same length")
    src = [wrap_dim(d, self.ndim) for d in source]
    dst = [wrap_dim(d, self.ndim) for d in destination]
    perm = [-1] * self.ndim
    for s, d in zip(src, dst):
        perm[d] = s
    rest = iter(d for d in range(self.ndim) if d not in src)
    perm = [p if p != -1 else next(rest) for p in perm]
    return jnp.transpose(self, perm) if self.ndim else self


# --------------------------------------------------------------------------- squeeze / unsqueeze


@lowers(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze_copy.default,
        aten.squeeze_copy.dim, aten.squeeze_copy.dims)
def squeeze(self, dim=None):
    """Drop size-1 dims: all of them, or those of ``dim`` that have size 1 (others stay)."""
    if dim is None:
        dims = range(self.ndim)
    else:
        dims = [dim] if isinstance(dim, int) else list(dim)
        dims = [wrap_dim(d, self.ndim) for d in dims]
    axes = tuple(sorted({d for d in dims if self.ndim and self.shape[d] == 1}))
    return lax.squeeze(self, axes) if axes else self


@lowers(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def unsqueeze(self, dim):
    """Insert a size-1 dim at ``dim`` (which wraps over ``ndim + 1``)."""
    return lax.expand_dims(self, (wrap_dim(dim, self.ndim + 1),))


# --------------------------------------------------------------------------- slicing


@lowers(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_tensor(self, dim=0, start=None, end=None, step=1):
    """``self[..., start:end:step]`` on ``dim`` with torch's clamping of the bounds."""
    dim = wrap_dim(dim, self.ndim)
    start, end = slice_bounds(self.shape[dim], start, end, step)
    return slice_along(self, dim, start, end, step)


@lowers(aten.narrow.default, aten.narrow_copy.default)
def narrow(self, dim, start, length):
    """``length`` elements of ``dim`` from ``start`` (negative ``start`` wraps)."""
    dim = wrap_dim(dim, self.ndim)
    size = self.shape[dim]
    if start < 0:
        start += size
    if not (0 <= start <= size and 0 <= length <= size - start):
        raise IndexError(f"narrow: start ({start}) + length ({length}) exceeds dimension size "
                         f"({size})")
    return slice_along(self, dim, start, start + length)


@lowers(aten.narrow.Tensor)
def narrow_at(self, dim, start, length):
    """``narrow`` from a 0-dim ``start`` tensor, whose value may be known only on the device.

    A start past the end is clamped (a dynamic slice cannot fail at run time).
    """
    dim = wrap_dim(dim, self.ndim)
    size = self.shape[dim]
    if not 0 <= length <= size:
        raise IndexError(f"narrow: length ({length}) exceeds dimension size ({size})")
    start = jnp.reshape(start, ()).astype(jnp.int32)
    start = jnp.where(start < 0, start + size, start)
    return lax.dynamic_slice_in_dim(self, start, length, axis=dim)


@lowers(aten.select.int, aten.select_copy.int)
def select(self, dim, index):
    """Index ``dim`` at one position, dropping that dim (negative ``index`` wraps)."""
    dim = wrap_dim(dim, self.ndim)
    size = self.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"select(): index {index} out of range for tensor of size "
                         f"{tuple(self.shape)} at dimension {dim}")
    return lax.index_in_dim(self, index % size, axis=dim, keepdims=False)


def diagonal_geometry(rows: int, cols: int, offset: int) -> tuple[int, int]:
    """Where a diagonal lies in a row-major ``rows x cols`` matrix: (first flat index, length).

    Consecutive diagonal elements are ``cols + 1`` apart in the flattened matrix, which lets
    a diagonal be read or written as one strided slice of it.
    """
    if offset >= 0:
        length = max(0, min(rows, cols - offset))
        return offset, length
    length = max(0, min(rows + offset, cols))
    return -offset * cols, length


@lowers(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal(self, offset=0, dim1=0, dim2=1):
    """The diagonal of the (dim1, dim2) planes, appended as the last dim."""
    d1, d2 = wrap_dim(dim1, self.ndim), wrap_dim(dim2, self.ndim)
    if d1 == d2:
        raise RuntimeError("diagonal dimensions cannot be identical")
    others = [d for d in range(self.ndim) if d not in (d1, d2)]
    planes = jnp.transpose(self, others + [d1, d2])
    rows, cols = self.shape[d1], self.shape[d2]
    batch = planes.shape[:-2]
    first, length = diagonal_geometry(rows, cols, offset)
    if length == 0:
        return jnp.zeros(batch + (0,), self.dtype)
    flat = jnp.reshape(planes, batch + (rows * cols,))
    stride = cols + 1
    return lax.slice_in_dim(flat, first, first + (length - 1) * stride + 1, stride,
                            axis=flat.ndim - 1)


# A window this long or shorter is built from strided slices; longer ones use one gather.
_UNFOLD_MAX_SLICES = 32


@lowers(aten.unfold.default, aten.unfold_copy.default)
def unfold(self, dimension, size, step):
    """Sliding windows of ``size`` every ``step`` along ``dimension``; windows go last."""
    if self.ndim == 0:
        wrap_dim(dimension, 0)
        if size > 1:
            raise RuntimeError(f"maximum size for tensor at dimension 0 is 1 but size is {size}")
        return jnp.reshape(self, (1,))[:size]
    dim = wrap_dim(dimension, self.ndim)
    length = self.shape[dim]
    if size > length:
        raise RuntimeError(f"maximum size for tensor at dimension {dim} is {length} but size "
                           f"is {size}")
    if step <= 0:
        raise RuntimeError(f"step is {step} but must be > 0")
    windows = (length - size) // step + 1
    moved = jnp.moveaxis(self, dim, -1)
    if size == step or windows == 1:
        # Non-overlapping, adjacent windows are a plain reshape of a prefix.
        prefix = lax.slice_in_dim(moved, 0, windows * size, axis=moved.ndim - 1)
        out = jnp.reshape(prefix, moved.shape[:-1] + (windows, size))
    elif size <= _UNFOLD_MAX_SLICES:
        last = (windows - 1) * step
        parts = [lax.slice_in_dim(moved, j, j + last + 1, step, axis=moved.ndim - 1)
                 for j in range(size)]
        out = jnp.stack(parts, axis=-1) if parts else jnp.zeros(
            moved.shape[:-1] + (windows, 0), self.dtype)
    else:
        index = np.arange(windows)[:, None] * step + np.arange(size)[None, :]
        out = jnp.take(moved, jnp.asarray(index, jnp.int32), axis=-1)
    return jnp.moveaxis(out, -2, dim)


# --------------------------------------------------------------------------- splits


def _split_at(self, sizes: Sequence[int], dim: int):
    dim = wrap_dim(dim, self.ndim)
    if sum(sizes) != self.shape[dim] or any(s < 0 for s in sizes):
        raise RuntimeError(f"split_with_sizes expects split_sizes to sum exactly to "
                           f"{self.shape[dim]} (input tensor's size at dimension {dim}), but "
                           f"got split_sizes={list(sizes)}")
    pieces, start = [], 0
    for s in sizes:
        pieces.append(slice_along(self, dim, start, start + s))
        start += s
    return pieces


@lowers(aten.split_with_sizes.default, aten.split_with_sizes_copy.default, aten.split.sizes,
        aten.unsafe_split_with_sizes.default)
def split_with_sizes(self, split_sizes, dim=0):
    """Consecutive static slices of the given sizes along ``dim``."""
    return _split_at(self, [int(s) for s in split_sizes], dim)


def _split_sizes(length: int, split_size: int) -> list[int]:
    if split_size < 0:
        raise RuntimeError("split expects split_size be non-negative")
    if split_size == 0:
        if length:
            raise RuntimeError(f"split_size can only be 0 if dimension size is 0, but got "
                               f"dimension size of {length}")
        return [0]
    count = max(1, -(-length // split_size))
    return [min(split_size, length - i * split_size) for i in range(count)]


@lowers(aten.split.Tensor, aten.split_copy.Tensor, aten.unsafe_split.Tensor)
def split(self, split_size, dim=0):
    """Pieces of ``split_size`` along ``dim`` (the last may be smaller)."""
    d = wrap_dim(dim, self.ndim)
    return _split_at(self, _split_sizes(self.shape[d], int(split_size)), d)


@lowers(aten.chunk.default, aten.unsafe_chunk.default)
def chunk(self, chunks, dim=0):
    """At most ``chunks`` pieces of equal size ``ceil(size / chunks)`` (the last may be less)."""
    if chunks <= 0:
        raise RuntimeError(f"chunk expects `chunks` to be greater than 0, got: {chunks}")
    d = wrap_dim(dim, self.ndim)
    length = self.shape[d]
    if length == 0:
        # torch gives ``chunks`` empty pieces here, where split would give one.
        return _split_at(self, [0] * chunks, d)
    return split(self, -(-length // chunks), d)


@lowers(aten.unbind.int, aten.unbind_copy.int)
def unbind(self, dim=0):
    """Every index of ``dim`` as its own tensor, without that dim."""
    d = wrap_dim(dim, self.ndim)
    return [lax.index_in_dim(self, i, axis=d, keepdims=False) for i in range(self.shape[d])]


# --------------------------------------------------------------------------- complex views


@lowers(aten.view_as_real.default, aten.view_as_real_copy.default)
def view_as_real(self):
    """A complex tensor as real pairs in a new last dim of size 2."""
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@lowers(aten.view_as_complex.default, aten.view_as_complex_copy.default)
def view_as_complex(self):
    """Real pairs in the last dim (of size 2) as one complex tensor."""
    if self.ndim == 0 or self.shape[-1] != 2:
        raise RuntimeError("Tensor must have a last dimension of size 2")
    real = lax.index_in_dim(self, 0, axis=self.ndim - 1, keepdims=False)
    imag = lax.index_in_dim(self, 1, axis=self.ndim - 1, keepdims=False)
    return lax.complex(real.astype(jnp.float32), imag.astype(jnp.float32))


# --------------------------------------------------------------------------- joins and tiling


@lowers(aten.cat.default, aten.concat.default, aten.concatenate.default)
def cat(tensors, dim=0):
    """Concatenate along ``dim``; like torch, 1-D tensors of size 0 are skipped."""
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        dtype = jnp.result_type(*tensors) if tensors else jnp.float32
        return jnp.zeros((0,), dtype)
    dim = wrap_dim(dim, kept[0].ndim)
    if len(kept) == 1:
        return kept[0]
    dtype = jnp.result_type(*kept)
    return lax.concatenate([t.astype(dtype) for t in kept], dim)


@lowers(aten.stack.default)
def stack(tensors, dim=0):
    """Join equally shaped tensors along a new dim ``dim`` (which wraps over ``ndim + 1``)."""
    if not tensors:
        raise RuntimeError("stack expects a non-empty TensorList")
    dim = wrap_dim(dim, tensors[0].ndim + 1)
    dtype = jnp.result_type(*tensors)
    return lax.concatenate([lax.expand_dims(t.astype(dtype), (dim,)) for t in tensors], dim)


@lowers(aten.flip.default)
def flip(self, dims):
    """Reverse the order of elements along ``dims``."""
    axes = tuple(sorted({wrap_dim(d, self.ndim) for d in dims}))
    if self.ndim == 0 or not axes:
        return self
    return lax.rev(self, axes)


def _roll_dim(x, shift: int, dim: int):
    size = x.shape[dim]
    if size == 0:
        return x
    shift %= size
    if shift == 0:
        return x
    return lax.concatenate([slice_along(x, dim, size - shift, size),
                            slice_along(x, dim, 0, size - shift)], dim)


@lowers(aten.roll.default)
def roll(self, shifts, dims=()):
    """Rotate elements along ``dims`` by ``shifts`` (the flattened tensor when ``dims`` is empty)."""
    shifts, dims = list(shifts), list(dims)
    if not dims:
        if len(shifts) != 1:
            raise RuntimeError("roll: `shifts` must have one element when `dims` is empty")
        return jnp.reshape(_roll_dim(jnp.reshape(self, (-1,)), shifts[0], 0), self.shape)
    if len(shifts) != len(dims):
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, dims: "
                           f"{len(dims)}")
    out = self
    for shift, dim in zip(shifts, dims):
        out = _roll_dim(out, shift, wrap_dim(dim, self.ndim))
    return out


@lowers(aten.repeat.default)
def repeat(self, repeats):
    """Tile ``self`` ``repeats[i]`` times along each dim (extra leading repeats add dims).

    Built as a broadcast to interleaved (repeat, size) dims and a reshape, which XLA keeps as
    one broadcast instead of copies.
    """
    repeats = [int(r) for r in repeats]
    if len(repeats) < self.ndim:
        raise RuntimeError("Number of dimensions of repeat dims can not be smaller than number "
                           "of dimensions of tensor")
    shape = (1,) * (len(repeats) - self.ndim) + tuple(self.shape)
    interleaved = [1 for _ in range(2 * len(shape))]
    interleaved[1::2] = shape
    widened = [v for pair in zip(repeats, shape) for v in pair]
    base = jnp.reshape(self, interleaved)
    out_shape = tuple(r * n for r, n in zip(repeats, shape))
    return jnp.reshape(jnp.broadcast_to(base, widened), out_shape)


@lowers(aten.tile.default)
def tile(self, dims):
    """``repeat`` with missing leading repeat counts taken as 1."""
    dims = list(dims)
    return repeat(self, [1] * (self.ndim - len(dims)) + dims)


def _triangle_mask(shape, diagonal: int, lower: bool):
    rows = lax.broadcasted_iota(jnp.int32, shape[-2:], 0)
    cols = lax.broadcasted_iota(jnp.int32, shape[-2:], 1)
    return cols - rows <= diagonal if lower else cols - rows >= diagonal


@lowers(aten.tril.default)
def tril(self, diagonal=0):
    """Zero the elements above the ``diagonal``-th diagonal of the last two dims."""
    if self.ndim < 2:
        raise RuntimeError("tril: input tensor must have at least 2 dimensions")
    return jnp.where(_triangle_mask(self.shape, diagonal, True), self,
                     jnp.zeros((), self.dtype))


@lowers(aten.triu.default)
def triu(self, diagonal=0):
    """Zero the elements below the ``diagonal``-th diagonal of the last two dims."""
    if self.ndim < 2:
        raise RuntimeError("triu: input tensor must have at least 2 dimensions")
    return jnp.where(_triangle_mask(self.shape, diagonal, False), self,
                     jnp.zeros((), self.dtype))
