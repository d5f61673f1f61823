"""Factory kernels for the PrivateUse1 (``tpu``) dispatch key.

Factories such as ``torch.empty(..., device="tpu")`` have no tensor argument, so they never
reach ``__torch_dispatch__``: they dispatch on the device's key. These kernels allocate a
storage on the right PJRT device and return a :class:`TpuTensor`. Everything else (randn,
zeros, ...) is built by torch from these plus ops on the new tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpu_train.device import runtime
from tpu_train.device.storage import Storage, allocate, contiguous_strides
from tpu_train.device.tensor import TpuTensor, wrap
from tpu_train.ops.dtypes import storage_dtype

_library = None


def _index(device) -> int:
    device = torch.device(device) if device is not None else torch.device("tpu")
    if device.index is None:
        from tpu_train.device import module

        return module.current_device()
    runtime.jax_device(device.index)  # range check with a clear message
    return device.index


def _dtype(dtype) -> torch.dtype:
    return dtype if dtype is not None else torch.get_default_dtype()


def _strided(size, stride, dtype, device, fill=None) -> TpuTensor:
    """A new tensor of ``size`` and ``stride`` filled with ``fill``; None: ``empty``'s,
    whose buffer is made when first read (:meth:`Storage.unfilled`)."""
    index = _index(device)
    size, stride = tuple(size), tuple(stride)
    if any(n < 0 for n in size):
        raise RuntimeError(f"Trying to create tensor with negative dimension: {list(size)}")
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
    if fill is None:
        storage = Storage.unfilled(extent, dtype, index)
    else:
        storage = Storage(allocate(extent, dtype, index, fill), dtype, index)
    return TpuTensor(storage, size, stride, 0)


def empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None,
                        memory_format=None):
    size = tuple(size)
    dtype = _dtype(dtype)
    if memory_format in (torch.channels_last, torch.channels_last_3d) and len(size) in (4, 5):
        meta = torch.empty(size, dtype=dtype, device="meta", memory_format=memory_format)
        return _strided(size, meta.stride(), dtype, device)
    return _strided(size, contiguous_strides(size), dtype, device)


def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return _strided(size, stride, _dtype(dtype), device)


def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    if dtype is None:
        dtype = (torch.bool if isinstance(fill_value, bool) else
                 torch.int64 if isinstance(fill_value, int) else torch.get_default_dtype())
    return _strided(tuple(size), contiguous_strides(tuple(size)), dtype, device, fill_value)


def scalar_tensor(value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return full((), value, dtype=dtype, device=device)


def arange_start_step(start, end, step=1, *, dtype=None, layout=None, device=None,
                      pin_memory=None):
    index = _index(device)
    if dtype is None and _ascending_or_descending_ints(start, end, step):
        # Positions (transformers calls arange on every forward): int64, exactly Python's range.
        out_dtype, host = torch.int64, np.arange(start, end, step, dtype=np.int64)
    else:
        # torch's meta kernel gives the exact length and dtype rules (float steps included) and
        # its errors.
        meta = torch.arange(start, end, step, dtype=dtype, device="meta")
        values = start + step * np.arange(meta.numel(), dtype=np.float64)
        out_dtype = meta.dtype
        host = values if meta.dtype.is_floating_point else np.floor(values)
    host = host.astype(storage_dtype(out_dtype))
    # A plain transfer of the host array, already flat: no device op.
    buffer = jax.device_put(host, runtime.jax_device(index))
    return TpuTensor(Storage(buffer, out_dtype, index), host.shape, (1,), 0)


def _ascending_or_descending_ints(start, end, step) -> bool:
    if type(start) is not int or type(end) is not int or type(step) is not int:
        return False
    return (step > 0 and end >= start) or (step < 0 and end <= start)


def arange_start(start, end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return arange_start_step(start, end, 1, dtype=dtype, device=device)


def arange_end(end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return arange_start_step(0, end, 1, dtype=dtype, device=device)


def ones(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return full(size, 1, dtype=_dtype(dtype), device=device)


def zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return full(size, 0, dtype=_dtype(dtype), device=device)


def eye(n, m=None, *, dtype=None, layout=None, device=None, pin_memory=None):
    m = n if m is None else m
    dtype = _dtype(dtype)
    index = _index(device)
    array = jnp.eye(n, m, dtype=storage_dtype(dtype), device=runtime.jax_device(index))
    return wrap(array, dtype, index, (n, m))


def eye_m(n, m, *, dtype=None, layout=None, device=None, pin_memory=None):
    return eye(n, m, dtype=dtype, device=device)


def copy_from(self, dst, non_blocking=False):
    """``torch.tensor(data, device="tpu")`` copies a CPU tensor into a fresh tpu tensor with
    ``_copy_from`` under dispatch keys that bypass ``__torch_dispatch__``."""
    from tpu_train.device.mutation import assign

    if dst.numel() == 0:  # torch.tensor([]): transformers' caches start so every forward
        return dst
    assign(dst, self, "_copy_from")
    return dst


def register() -> None:
    """Register the kernels once per process (the library object must stay alive)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL", "PrivateUse1")
    kernels = {
        "empty.memory_format": empty_memory_format,
        "empty_strided": empty_strided,
        "full": full,
        "scalar_tensor": scalar_tensor,
        "arange.start_step": arange_start_step,
        "arange.start": arange_start,
        "arange": arange_end,
        "ones": ones,
        "zeros": zeros,
        # Autograd's zero gradients (sgn of a complex 0, ...): plain zeros here; CPU and CUDA
        # mark theirs with the ZeroTensor key only to skip arithmetic on them.
        "_efficientzerotensor": zeros,
        "_copy_from": copy_from,
        "eye": eye,
        "eye.m": eye_m,
    }
    for name, kernel in kernels.items():
        library.impl(name, kernel)
    _library = library

