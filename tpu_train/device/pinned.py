"""Pinned host memory for the ``tpu`` device, and asynchronous host-to-device copies from it.

Once ``tpu`` is PyTorch's accelerator, ``tensor.pin_memory()`` and ``DataLoader(pin_memory=
True)`` ask it for a pinned-memory allocator through the C++ hook
``PrivateUse1HooksInterface::getPinnedMemoryAllocator``, which a Python backend cannot
implement: every ordinary training script that pins its batches crashed. PyTorch's own
kernels for ``aten::_pin_memory`` and ``aten::is_pinned`` are composite ones, so
:func:`register` gives the CPU dispatch key kernels of its own (``torch.library``):

* ``_pin_memory`` copies the tensor into a host buffer that this module owns and records;
  ``is_pinned`` is true for tensors (and views) whose storage is such a buffer. The buffer is
  ordinary pageable memory: page-locking for DMA happens inside the PJRT client, which stages
  host buffers itself, so what "pinned" buys here is the CUDA contract below.
* A ``copy_``/``.to("tpu", non_blocking=True)`` from a pinned tensor into a whole tpu tensor
  returns at once; one transfer thread converts and uploads the buffer, and the tpu tensor's
  storage waits for it when first read (:meth:`Storage.fill_later`). As on CUDA, the source
  must not be written until the copy is done: ``torch.tpu.synchronize()`` /
  ``torch.accelerator.synchronize()`` wait for every transfer started before them. Copies from
  unpinned memory, or blocking ones, stay synchronous and take a snapshot of the source.
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref

import jax
import numpy as np
import torch

from tpu_train.device import runtime

DEVICE_TYPE = "tpu"
_lock = threading.Lock()
_buffers: dict = {}  # data pointer -> weakref to the numpy buffer behind a pinned storage
_transfers = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpu_h2d")
_library = None


def _forget(pointer: int):
    def callback(_):
        with _lock:
            _buffers.pop(pointer, None)

    return callback


def _check_device(device) -> None:
    if device is not None and torch.device(device).type != DEVICE_TYPE:
        raise RuntimeError(
            f"pin_memory for device {device}: in a process using the tpu device, pinned host "
            f"memory is the tpu device's (PyTorch has one accelerator per process)")


def is_pinned(tensor: torch.Tensor, device=None) -> bool:
    _check_device(device)
    pointer = tensor.untyped_storage().data_ptr()
    with _lock:
        buffer = _buffers.get(pointer)
    return buffer is not None and buffer() is not None


def pin_memory(tensor: torch.Tensor, device=None) -> torch.Tensor:
    """A pinned copy of a CPU tensor (contiguous, same values, dtype and shape)."""
    _check_device(device)
    nbytes = tensor.numel() * tensor.element_size()
    buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
    # from_numpy keeps the array alive as long as the storage: the weakref dies with it.
    pinned = torch.from_numpy(buffer)[:nbytes].view(tensor.dtype).view(tensor.shape)
    pointer = pinned.untyped_storage().data_ptr()
    with _lock:
        _buffers[pointer] = weakref.ref(buffer, _forget(pointer))
    pinned.copy_(tensor)
    return pinned


def copy_async(destination, source: torch.Tensor) -> bool:
    """Start copying pinned ``source`` into the whole of tpu ``destination`` in the
    background; False (nothing done) when the copy does not qualify."""
    from tpu_train.device.tensor import owns_whole_storage, put_cpu_tensor

    if not (source.device.type == "cpu" and source.dtype == destination.dtype
            and tuple(source.shape) == tuple(destination.shape) and source.is_contiguous()
            and owns_whole_storage(destination) and is_pinned(source)):
        return False
    jax_device = runtime.jax_device(destination.device.index)

    def transfer():
        # Converts dtypes (int64 is stored as int32) and copies, here, off the caller's thread.
        return put_cpu_tensor(source, jax_device)

    destination._storage.fill_later(_transfers.submit(transfer))
    return True


def wait_for_transfers() -> None:
    """Return once every asynchronous host-to-device copy started so far has finished."""
    _transfers.submit(lambda: None).result()  # one worker, first in first out


def register() -> None:
    """The CPU kernels of ``aten::_pin_memory`` and ``aten::is_pinned`` (once per process)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL", "CPU")
    library.impl("_pin_memory", pin_memory)
    library.impl("is_pinned", is_pinned)
    _library = library
