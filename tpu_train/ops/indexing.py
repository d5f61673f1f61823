"""Lowerings of advanced indexing, gathers and scatters.

Index tensors arrive as int32 arrays (torch's int64 is stored as int32). Negative indices
wrap like torch where torch accepts them (``index``, ``index_put``, ``take``, ``put``,
``index_fill``...). Boolean masks in ``index`` / ``index_put`` select a data-dependent number
of elements: they are turned into integer indices from concrete values, so they only work
eagerly — except ``index_put`` with a mask and a value that is the same for every selected
element (``x[mask] = v``), which is a ``where`` and compiles.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from tpu_train.ops.registry import aten, lowers
from tpu_train.ops.shape import wrap_dim


def _is_mask(index) -> bool:
    return index is not None and index.dtype in (jnp.bool_, jnp.uint8)


def _concrete(array, op: str) -> np.ndarray:
    try:
        return np.asarray(array)
    except Exception as error:  # a tracer: the op needs values known on the host
        raise NotImplementedError(
            f"{op} with a boolean mask (or another data-dependent output shape) needs concrete "
            "values: it works eagerly, not inside a compiled step") from error


def _integer_indices(self, indices: Sequence, op: str) -> list:
    """``indices`` with every boolean mask replaced by the integer indices of its True entries."""
    expanded, dim = [], 0
    for index in indices:
        if _is_mask(index):
            if index.ndim == 0:
                raise NotImplementedError(f"{op}: a 0-dim boolean index is not supported")
            mask = _concrete(index, op).astype(bool)
            expected = tuple(self.shape[dim:dim + mask.ndim])
            if mask.shape != expected:
                raise IndexError(f"The shape of the mask {list(mask.shape)} at index {dim} does "
                                 f"not match the shape of the indexed tensor {list(expected)}")
            expanded.extend(jnp.asarray(i, jnp.int32) for i in np.nonzero(mask))
            dim += mask.ndim
        else:
            expanded.append(index)
            dim += 1
    if len(expanded) > max(self.ndim, 1) or (self.ndim == 0 and expanded):
        raise IndexError(f"too many indices for tensor of dimension {self.ndim} (got "
                         f"{len(expanded)})")
    return expanded


def _numpy_key(indices: Sequence) -> tuple:
    # NumPy's advanced-indexing rule is torch's: advanced dims stay in place when the indexed
    # dims are adjacent, and move to the front otherwise.
    return tuple(slice(None) if i is None else i.astype(jnp.int32) for i in indices)


@lowers(aten.index.Tensor, aten.index.Tensor_hacked_twin, aten._unsafe_index.Tensor,
        aten._unsafe_index.Tensor_hacked_twin)
def index(self, indices):
    """``self[indices]`` with torch's advanced indexing (None entries keep a dim whole).

    Boolean masks are eager-only (see the module docstring).
    """
    return self[_numpy_key(_integer_indices(self, indices, "index"))]


def _mask_put(self, indices, values, accumulate: bool):
    """``self[mask] = values`` as a ``where`` when ``values`` is the same for every masked
    element (it broadcasts over the masked dims); None when the general path is needed."""
    leading = 0
    while leading < len(indices) and indices[leading] is None:
        leading += 1
    rest = indices[leading + 1:]
    if leading == len(indices) or not _is_mask(indices[leading]) or any(
            i is not None for i in rest):
        return None
    mask = indices[leading].astype(jnp.bool_)
    if mask.ndim == 0 or tuple(mask.shape) != tuple(self.shape[leading:leading + mask.ndim]):
        return None
    trailing = self.shape[leading + mask.ndim:]
    selected_shape = tuple(self.shape[:leading]) + (-1,) + tuple(trailing)
    if values.ndim > len(selected_shape):
        return None
    aligned = (1,) * (len(selected_shape) - values.ndim) + tuple(values.shape)
    if aligned[leading] != 1:
        return None  # one value per selected element: needs their positions
    value_shape = aligned[:leading] + (1,) * mask.ndim + aligned[leading + 1:]
    spread = jnp.reshape(values.astype(self.dtype), value_shape)
    where = jnp.reshape(mask, (1,) * leading + tuple(mask.shape) + (1,) * len(trailing))
    if accumulate:
        return self + jnp.where(where, spread, jnp.zeros((), self.dtype))
    return jnp.where(where, spread, self)


@lowers(aten.index_put.default, aten.index_put.hacked_twin, aten._index_put_impl.default,
        aten._unsafe_index_put.default, aten._unsafe_index_put.hacked_twin)
def index_put(self, indices, values, accumulate=False, unsafe=False):
    """``self`` with ``self[indices]`` set to (or, accumulating, incremented by) ``values``.

    A boolean mask with a value shared by all selected elements compiles; other masks are
    eager-only. With duplicate indices and ``accumulate=False`` torch leaves which write wins
    unspecified.
    """
    masked = _mask_put(self, list(indices), values, accumulate)
    if masked is not None:
        return masked
    key = _numpy_key(_integer_indices(self, indices, "index_put"))
    values = values.astype(self.dtype)
    return self.at[key].add(values) if accumulate else self.at[key].set(values)


def _clamped(indices, shape):
    """Indices clamped into range: masked-out entries of the masked ops may hold any value."""
    return [None if i is None else jnp.clip(i.astype(jnp.int32), -n, n - 1)
            for i, n in zip(indices, shape)]


@lowers(aten._unsafe_masked_index.default)
def _unsafe_masked_index(self, mask, indices, fill):
    """``where(mask, self[indices], fill)``; indices where ``mask`` is False are ignored."""
    gathered = self[_numpy_key(_clamped(indices, self.shape))]
    return jnp.where(mask, gathered, jnp.asarray(fill, self.dtype))


@lowers(aten._unsafe_masked_index_put_accumulate.default)
def _unsafe_masked_index_put_accumulate(self, mask, indices, values):
    """``self[indices] += values`` for the elements where ``mask`` is True."""
    kept = jnp.where(mask, values.astype(self.dtype), jnp.zeros((), self.dtype))
    return self.at[_numpy_key(_clamped(indices, self.shape))].add(kept)


# --------------------------------------------------------------------------- dim-wise indexing


def _along(dim: int, index) -> tuple:
    return (slice(None),) * dim + (index,)


def _as_vector(index):
    return jnp.reshape(index.astype(jnp.int32), (-1,))


def _with_1d(op):
    """Run ``op`` on a 0-dim ``self`` as if it were 1-D of size 1 (as torch does)."""

    def run(self, dim, *args, **kwargs):
        if self.ndim:
            return op(self, wrap_dim(dim, self.ndim), *args, **kwargs)
        wrap_dim(dim, 0)
        return jnp.reshape(op(jnp.reshape(self, (1,)), 0, *args, **kwargs), ())

    run.__name__, run.__doc__ = op.__name__, op.__doc__
    return run


@lowers(aten.index_select.default)
@_with_1d
def index_select(self, dim, index):
    """The entries ``index`` (a vector or a scalar) of ``dim``."""
    return self[_along(dim, _as_vector(index))]


@lowers(aten.index_add.default)
@_with_1d
def index_add(self, dim, index, source, alpha=1):
    """``self`` with ``alpha * source[..., i, ...]`` added to entry ``index[i]`` of ``dim``."""
    source = jnp.reshape(source, self.shape[:dim] + (index.size,) + self.shape[dim + 1:])
    if not (isinstance(alpha, (int, bool)) and alpha == 1):
        source = source * alpha
    return self.at[_along(dim, _as_vector(index))].add(source.astype(self.dtype))


@lowers(aten.index_copy.default)
@_with_1d
def index_copy(self, dim, index, source):
    """``self`` with entry ``index[i]`` of ``dim`` replaced by ``source[..., i, ...]``."""
    source = jnp.reshape(source, self.shape[:dim] + (index.size,) + self.shape[dim + 1:])
    return self.at[_along(dim, _as_vector(index))].set(source.astype(self.dtype))


@lowers(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
@_with_1d
def index_fill(self, dim, index, value):
    """``self`` with the entries ``index`` of ``dim`` set to ``value``."""
    return self.at[_along(dim, _as_vector(index))].set(jnp.asarray(value).astype(self.dtype))


@lowers(aten.index_reduce.default)
@_with_1d
def index_reduce(self, dim, index, source, reduce, include_self=True):
    """Reduce ``source[..., i, ...]`` into entry ``index[i]`` of ``dim`` (prod/mean/amax/amin)."""
    source = jnp.reshape(source, self.shape[:dim] + (index.size,) + self.shape[dim + 1:])
    shape = [1] * source.ndim
    shape[dim] = index.size
    spread = jnp.broadcast_to(jnp.reshape(_as_vector(index), shape), source.shape)
    return scatter_reduce(self, dim, spread, source, reduce, include_self=include_self)


# --------------------------------------------------------------------------- gather / scatter


def _element_key(dim: int, index) -> tuple:
    """The full coordinates ``scatter``/``gather`` address: ``index`` on ``dim``, the position
    itself on every other dim."""
    shape = index.shape
    return tuple(index.astype(jnp.int32) if d == dim else lax.broadcasted_iota(jnp.int32, shape, d)
                 for d in range(len(shape)))


def _prefix(array, shape):
    """The leading ``shape`` block of ``array`` (torch lets src be larger than index)."""
    return lax.slice(array, (0,) * array.ndim, tuple(shape))


@lowers(aten.gather.default)
@_with_1d
def gather(self, dim, index, *, sparse_grad=False):
    """``out[i][j][k] = self[i][index[i][j][k]][k]`` (for ``dim == 1``)."""
    index = jnp.reshape(index, index.shape if index.ndim else (1,))
    if index.size == 0:
        return jnp.zeros(index.shape, self.dtype)
    return self[_element_key(dim, index)]


def _scatter_key(self, dim, index):
    index = jnp.reshape(index, index.shape if index.ndim else (1,))
    return index, _element_key(dim, index)


def _scatter_src(src, index):
    if isinstance(src, (int, float, bool)) or getattr(src, "ndim", 0) == 0:
        return src
    return _prefix(jnp.reshape(src, src.shape if src.ndim else (1,)), index.shape)


_SCATTER_REDUCE = {"add": "add", "multiply": "multiply"}


@lowers(aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce)
@_with_1d
def scatter(self, dim, index, src, *, reduce=None):
    """``self`` with ``self[i][index[i][j]] = src[i][j]`` (for ``dim == 1``); ``src`` may be a
    scalar, and ``reduce`` ("add" / "multiply") combines instead of overwriting."""
    index, key = _scatter_key(self, dim, index)
    if index.size == 0:
        return self
    values = jnp.asarray(_scatter_src(src, index)).astype(self.dtype)
    if reduce is None:
        return self.at[key].set(values)
    if reduce not in _SCATTER_REDUCE:
        raise RuntimeError(f"reduce argument must be either add or multiply, got {reduce}")
    return getattr(self.at[key], _SCATTER_REDUCE[reduce])(values)


@lowers(aten.scatter_add.default)
@_with_1d
def scatter_add(self, dim, index, src):
    """``self`` with ``src[i][j]`` added to ``self[i][index[i][j]]`` (for ``dim == 1``)."""
    index, key = _scatter_key(self, dim, index)
    if index.size == 0:
        return self
    return self.at[key].add(_scatter_src(src, index).astype(self.dtype))


def _reduction_identity(reduce: str, dtype):
    if reduce in ("sum", "mean"):
        return jnp.zeros((), dtype)
    if reduce == "prod":
        return jnp.ones((), dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(-jnp.inf if reduce == "amax" else jnp.inf, dtype)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if reduce == "amax" else info.max, dtype)


_REDUCE_METHOD = {"sum": "add", "mean": "add", "prod": "multiply", "amax": "max", "amin": "min"}


@lowers(aten.scatter_reduce.two)
@_with_1d
def scatter_reduce(self, dim, index, src, reduce, *, include_self=True):
    """Reduce ``src`` into ``self`` at ``index`` along ``dim`` (sum/prod/mean/amax/amin).

    Without ``include_self`` the original values of the positions written to take no part;
    positions nobody writes to keep their value. An integer mean rounds down, like torch.
    """
    if reduce not in _REDUCE_METHOD:
        raise RuntimeError(f"reduce argument must be one of sum, prod, mean, amax, amin, got "
                           f"{reduce}")
    index, key = _scatter_key(self, dim, index)
    if index.size == 0:
        return self
    values = _scatter_src(src, index).astype(self.dtype)
    base = self
    if not include_self:
        written = jnp.zeros(self.shape, jnp.bool_).at[key].set(True)
        base = jnp.where(written, _reduction_identity(reduce, self.dtype), self)
    out = getattr(base.at[key], _REDUCE_METHOD[reduce])(values)
    if reduce != "mean":
        return out
    count = jnp.full(self.shape, 1 if include_self else 0, jnp.int32).at[key].add(1)
    count = jnp.maximum(count, 1).astype(self.dtype)
    if jnp.issubdtype(self.dtype, jnp.floating):
        return out / count
    return jnp.floor_divide(out, count)


# --------------------------------------------------------------------------- flat indexing


def _wrapped(index, size: int):
    index = index.astype(jnp.int32)
    return jnp.where(index < 0, index + size, index)


@lowers(aten.take.default)
def take(self, index):
    """``self.flatten()[index]``; negative indices wrap."""
    if index.size == 0:
        return jnp.zeros(index.shape, self.dtype)
    flat = jnp.reshape(self, (-1,))
    return flat[_wrapped(index, flat.size)]


@lowers(aten.put.default)
def put(self, index, source, accumulate=False):
    """``self`` with flat positions ``index`` set to (or incremented by) ``source``."""
    if index.size == 0:
        return self
    flat = jnp.reshape(self, (-1,))
    values = jnp.reshape(source, index.shape).astype(self.dtype)
    at = flat.at[_wrapped(index, flat.size)]
    return jnp.reshape(at.add(values) if accumulate else at.set(values), self.shape)


@lowers(aten.masked_scatter.default)
def masked_scatter(self, mask, source):
    """The masked positions of ``self`` filled, in order, by consecutive ``source`` elements.

    Static shapes: each position's source element is found by a running count of the mask.
    """
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    flat_mask = jnp.reshape(jnp.broadcast_to(mask.astype(jnp.bool_), shape), (-1,))
    flat_self = jnp.reshape(jnp.broadcast_to(self, shape), (-1,))
    if source.size == 0 or flat_mask.size == 0:
        return jnp.reshape(flat_self, shape)
    order = jnp.cumsum(flat_mask.astype(jnp.int32)) - 1
    picked = jnp.reshape(source, (-1,))[jnp.clip(order, 0, source.size - 1)]
    return jnp.reshape(jnp.where(flat_mask, picked.astype(self.dtype), flat_self), shape)


@lowers(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad_output, mask, sizes):
    """The gradient of ``masked_scatter``'s source: ``grad_output`` at the masked positions in
    order, zero-padded to the source's size."""
    numel = int(np.prod(sizes))
    flat_mask = jnp.reshape(jnp.broadcast_to(mask.astype(jnp.bool_), grad_output.shape), (-1,))
    order = jnp.cumsum(flat_mask.astype(jnp.int32)) - 1
    target = jnp.where(flat_mask, order, numel)
    flat = jnp.zeros((numel,), grad_output.dtype)
    flat = flat.at[target].set(jnp.reshape(grad_output, (-1,)), mode="drop")
    return jnp.reshape(flat, tuple(sizes))


@lowers(aten.masked_select.default)
def masked_select(self, mask):
    """The elements of ``self`` where ``mask`` is True, as a vector (eager-only: its length
    depends on the mask's values)."""
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    where = _concrete(jnp.broadcast_to(mask, shape), "masked_select").reshape(-1)
    positions = jnp.asarray(np.flatnonzero(where), jnp.int32)
    return jnp.reshape(jnp.broadcast_to(self, shape), (-1,))[positions]


@lowers(aten.nonzero.default)
def nonzero(self):
    """The coordinates of nonzero elements, one row each (eager-only: data-dependent length)."""
    return jnp.asarray(np.argwhere(_concrete(self, "nonzero")), jnp.int32)


@lowers(aten.nonzero_static.default)
def nonzero_static(self, *, size, fill_value=-1):
    """The first ``size`` coordinates of nonzero elements, padded with ``fill_value`` rows."""
    if self.ndim == 0:
        self = jnp.reshape(self, (1,))
        found = jnp.argwhere(self, size=size, fill_value=fill_value)
        return jnp.reshape(found, (size, 0))
    return jnp.argwhere(self, size=size, fill_value=fill_value).astype(jnp.int32)
