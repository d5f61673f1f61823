"""Ops whose meaning involves devices or the host, handled before the lowering table."""

from __future__ import annotations

import jax
import numpy
import torch

import math

from torch.utils._mode_utils import no_dispatch

from tpu_train.device import inplace, op_cache, pinned, runtime
from tpu_train.device.mutation import assign
from tpu_train.device.storage import Storage, contiguous_strides
from tpu_train.device.tensor import TpuTensor, from_host, refresh_key_part, to_host, wrap
from tpu_train.ops.dtypes import storage_dtype

aten = torch.ops.aten

# The SDPA backend (torch.nn.attention.SDPBackend index) this device asks torch for: the
# "overrideable" fused op, lowered here, which is the hook for a TPU flash-attention kernel.
_SDP_OVERRIDEABLE = 4


def _to_copy(func, args, kwargs):
    source = args[0]
    dtype = kwargs.get("dtype") or source.dtype
    device = kwargs.get("device")
    device = torch.device(device) if device is not None else source.device
    if device.type == "cpu":
        host = to_host(source)
        return host.to(dtype) if host.dtype != dtype else host
    if device.type != "tpu":
        raise RuntimeError(f"cannot copy a tpu tensor to device {device} directly; go through .cpu()")
    index = source.device.index if device.index is None else device.index
    if index == source.device.index and kwargs.get("layout") in (None, torch.strided) \
            and not kwargs.get("pin_memory"):
        # A cast on one device is an ordinary op: one cached executable reads the view.
        return op_cache.run_lowered(op_cache.op_info(func), func, (source,), {"dtype": dtype})
    array = source.jax_value()
    if index != source.device.index:
        array = jax.device_put(array, runtime.jax_device(index))
    if array.dtype != storage_dtype(dtype):
        array = array.astype(storage_dtype(dtype))
    return wrap(array, dtype, index, source.shape)


def _copy_(func, args, kwargs):
    destination, source = args[0], args[1]
    if type(destination) is TpuTensor and type(source) is TpuTensor \
            and destination._storage.device_index == source._storage.device_index:
        # On one device a copy is an in-place op: one cached executable reads the source's
        # view, casts, and writes through the destination's.
        return inplace.run_mutating(op_cache.op_info(func), func, args, kwargs)
    if isinstance(destination, TpuTensor) and not isinstance(source, TpuTensor):
        if source.device.type != "cpu":
            raise RuntimeError(f"cannot copy from {source.device} into a tpu tensor; go through .cpu()")
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if non_blocking and pinned.copy_async(destination, source):
            return destination
    assign(destination, source, func)
    return destination


# Storages of at most this many elements are read whole by .item() (one host copy, reused).
_SMALL_STORAGE = 8


def _local_scalar_dense(func, args, kwargs):
    tensor = args[0]
    storage = tensor._storage
    if storage.numel > _SMALL_STORAGE or tensor.dtype != storage.dtype:
        return to_host(tensor).item()
    # An element of a small storage (a compiled step's metrics vector: loss, gradient norm,
    # lr): read from its buffer's host copy (fetched once, cached by the array), without a CPU
    # tensor in between: a loop reads a few of these a step, ~10 us each this way, not ~50.
    value = numpy.asarray(storage._resolved()).reshape(-1)[tensor.storage_offset()].item()
    dtype = tensor.dtype
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point:
        return float(value)
    return complex(value) if dtype.is_complex else int(value)


def _fused_sdp_choice(func, args, kwargs):
    return _SDP_OVERRIDEABLE


def _compatible_shallow_copy(func, args, kwargs):
    return all(isinstance(a, TpuTensor) for a in args[:2])


def set_geometry(tensor: TpuTensor, size, stride, offset: int) -> None:
    """Change a tpu tensor's own sizes/strides/offset in place (what in-place view ops do).

    The wrapper's metadata lives in its C++ TensorImpl; torch's meta kernel of ``as_strided_``
    run on the wrapper itself (dispatch disabled, meta kernels selected) updates it."""
    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            aten.as_strided_.default(tensor, list(size), list(stride), offset)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
    refresh_key_part(tensor)


def inplace_view(func, args, kwargs):
    """``squeeze_``, ``transpose_``, ``as_strided_``, ...: new geometry, same storage."""
    from tpu_train.device.meta import to_meta

    tensor = args[0]
    meta = to_meta(tensor)
    func(meta, *torch.utils._pytree.tree_map(to_meta, args[1:]),
         **torch.utils._pytree.tree_map(to_meta, kwargs))
    set_geometry(tensor, meta.shape, meta.stride(), meta.storage_offset())
    return tensor


def _resize_(func, args, kwargs):
    """Resize as PyTorch does: same storage when it is large enough, else a new, larger one
    that keeps the old elements (new elements are unspecified; here zero)."""
    tensor, size = args[0], tuple(args[1])
    if tuple(tensor.shape) == size:
        return tensor
    if kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
        raise NotImplementedError(f"resize_ of a tpu tensor with {kwargs['memory_format']}")
    strides = contiguous_strides(size)
    needed = tensor.storage_offset() + math.prod(size)
    storage = tensor._storage
    if needed > storage.numel:
        buffer = jax.numpy.zeros((needed,), storage.buffer.dtype, device=runtime.jax_device(
            storage.device_index))
        buffer = buffer.at[:storage.numel].set(storage.buffer)
        tensor._storage = Storage(buffer, storage.dtype, storage.device_index)
    try:
        set_geometry(tensor, size, strides, tensor.storage_offset())
    except RuntimeError as error:
        if "out of bounds" not in str(error):
            raise
        # The wrapper's own (data-less) PyTorch storage was sized when it was created and
        # cannot grow from Python.
        raise NotImplementedError(
            f"resize_ of a tpu tensor from {tuple(tensor.shape)} to {size} grows it beyond the "
            "size it was created with, which tpu tensors do not support; allocate a new tensor "
            "(torch.empty(..., device='tpu')) instead") from None
    return tensor


def _record_stream(func, args, kwargs):
    return None


def _set_source_tensor(func, args, kwargs):
    destination, source = args[0], args[1]
    if tuple(destination.shape) == tuple(source.shape) and destination.dtype == source.dtype \
            and destination.stride() == source.stride():
        destination._storage = source._storage
        refresh_key_part(destination)
        return destination
    raise NotImplementedError(
        "set_ between tpu tensors of different geometry is not supported")


def _lift_fresh_copy(func, args, kwargs):
    source = args[0]
    if isinstance(source, TpuTensor):
        return wrap(source.jax_value(), source.dtype, source.device.index, source.shape)
    return from_host(source, 0)


def _linalg_check_errors(func, args, kwargs):
    # Checking LAPACK-style info codes would force a host sync per op; like a compiled
    # program, the eager device reports no singular-matrix errors (results are NaN instead).
    return None


def _like_options(source, kwargs):
    return {"dtype": kwargs.get("dtype") or source.dtype,
            "device": kwargs.get("device") or source.device}


def _rand_like(func, args, kwargs):
    return torch.empty(args[0].shape, **_like_options(args[0], kwargs)).uniform_()


def _randn_like(func, args, kwargs):
    return torch.empty(args[0].shape, **_like_options(args[0], kwargs)).normal_()


def _randint_like(func, args, kwargs):
    low, high = (0, args[1]) if len(args) == 2 else (args[1], args[2])
    return torch.empty(args[0].shape, **_like_options(args[0], kwargs)).random_(low, high)


def _filled_like(fill):
    """``zeros_like`` / ``ones_like`` / ``empty_like`` (zeros, for determinism) /
    ``full_like`` (``fill`` None: the op's own value) from the source's shape and dtype alone,
    as a new contiguous tensor made by one fill. As an op of its own the source would be an
    input: on a TPU, whose whole buffers keep their tensors' shapes, reading it flattens the
    buffer first (a copy, and a program to compile per shape), for a value never used."""
    def handler(func, args, kwargs):
        value = args[1] if fill is None else fill
        return torch.full(args[0].shape, value, **_like_options(args[0], kwargs))

    return handler


def _new_empty_strided(func, args, kwargs):
    return torch.empty_strided(args[1], args[2], **_like_options(args[0], kwargs))


def _resize_as_(func, args, kwargs):
    return _resize_(aten.resize_.default, (args[0], tuple(args[1].shape)), kwargs)


def _materialized_conj(func, args, kwargs):
    # torch's lazy conjugation (``x.conj()`` of a complex tensor) and negation are views
    # carrying a flag that only native devices' Conjugate / Negative fallbacks resolve; a
    # wrapper subclass's later ops would never see it. Here they are copies, as in XLA:
    # values are exact, but writes through the result do not reach the base.
    return aten._conj_physical.default(args[0])


def _materialized_neg(func, args, kwargs):
    return aten.neg.default(args[0])


def _reinterpreted_copy(copy_op):
    """``view_as_real`` / ``view_as_complex`` reinterpret a storage's dtype, which a flat
    buffer of one dtype cannot alias: a copy, with the same caveat as ``_materialized_conj``
    (autograd's complex formulas and RoPE-style code only read the result)."""
    def handler(func, args, kwargs):
        return copy_op(*args, **kwargs)

    return handler


# Handlers for ops whose defining module may not be imported yet (importing it only to name
# the op would slow ``import tpu_train``), by the op's ``str`` (``namespace.name.overload``):
# the dispatcher moves one into HANDLERS the first time its op arrives.
HANDLERS_BY_NAME: dict = {}


HANDLERS = {
    aten._conj.default: _materialized_conj,
    aten._neg_view.default: _materialized_neg,
    aten.view_as_real.default: _reinterpreted_copy(aten.view_as_real_copy.default),
    aten.view_as_complex.default: _reinterpreted_copy(aten.view_as_complex_copy.default),
    aten._linalg_check_errors.default: _linalg_check_errors,
    aten.rand_like.default: _rand_like,
    aten.randn_like.default: _randn_like,
    aten.randint_like.default: _randint_like,
    aten.randint_like.low_dtype: _randint_like,
    aten.new_empty_strided.default: _new_empty_strided,
    aten.zeros_like.default: _filled_like(0),
    aten.ones_like.default: _filled_like(1),
    aten.empty_like.default: _filled_like(0),
    aten.full_like.default: _filled_like(None),
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten._fused_sdp_choice.default: _fused_sdp_choice,
    aten._has_compatible_shallow_copy_type.default: _compatible_shallow_copy,
    aten.resize_.default: _resize_,
    aten.resize_as_.default: _resize_as_,
    aten.record_stream.default: _record_stream,
    aten.set_.source_Tensor: _set_source_tensor,
    aten.lift_fresh_copy.default: _lift_fresh_copy,
}
