"""``torch.accelerator.*`` for the ``tpu`` device: synchronize, device index, memory statistics.

PyTorch answers these in C++: ``synchronize`` asks the device guard's ``synchronizeDevice``
and the memory functions ask the device's registered ``DeviceAllocator``. A Python backend
registers neither (``torch._C._acc.DeviceGuard`` exposes only ``type_`` to Python, and the
allocator registry is C++-only), so without help ``torch.accelerator.synchronize()`` raises
"Backend doesn't support synchronizing all streams on device", every memory function fails an
internal assert, and ``set_device_index`` is silently ignored.

:func:`install` therefore wraps those ``torch.accelerator`` functions once: a call that
targets the ``tpu`` device goes to ``torch.tpu`` (:mod:`tpu_train.device.module`), any other
goes to PyTorch's function unchanged. Code that bound a function before ``import tpu_train``
(``from torch.accelerator import synchronize``) keeps PyTorch's.
"""

from __future__ import annotations

import collections
import functools

import torch

DEVICE_TYPE = "tpu"
_NO_DEVICE_ARGUMENT = frozenset({"current_device_index", "current_device_idx", "empty_cache"})
_installed = False


def _targets_tpu(device) -> bool:
    if device is None or isinstance(device, int):
        current = torch.accelerator.current_accelerator()
        return current is not None and current.type == DEVICE_TYPE
    return torch.device(device).type == DEVICE_TYPE


def _routed(original, tpu_function, takes_device: bool = True):
    """``original(device)`` unless the device is a tpu one, then ``tpu_function(device)``."""

    if takes_device:
        def routed(device=None, /):
            return tpu_function(device) if _targets_tpu(device) else original(device)
    else:  # current_device_index(), empty_cache(): the current accelerator's
        def routed():
            return tpu_function() if _targets_tpu(None) else original()

    routed = functools.wraps(original)(routed)
    routed.__tpu_train__ = True
    return routed


def _memory_stats(device):
    from tpu_train.device import module

    return collections.OrderedDict(sorted(module.memory_stats(device).items()))


def _tpu_functions() -> dict:
    from tpu_train.device import module

    return {
        "synchronize": module.synchronize,
        "set_device_index": module.set_device,
        "set_device_idx": module.set_device,  # deprecated alias, still exported
        "current_device_index": module.current_device,
        "current_device_idx": module.current_device,
        "empty_cache": module.empty_cache,
        "memory_stats": _memory_stats,
        "reset_peak_memory_stats": module.reset_peak_memory_stats,
        "reset_accumulated_memory_stats": module.reset_accumulated_memory_stats,
        "get_memory_info": module.mem_get_info,
    }


def install() -> None:
    """Route ``torch.accelerator``'s device-specific functions for tpu (idempotent)."""
    global _installed
    if _installed:
        return
    memory = getattr(torch.accelerator, "memory", None)
    namespaces = [torch.accelerator] + ([memory] if memory is not None else [])
    for name, tpu_function in _tpu_functions().items():
        for namespace in namespaces:
            original = getattr(namespace, name, None)
            if original is None or getattr(original, "__tpu_train__", False):
                continue
            takes_device = name not in _NO_DEVICE_ARGUMENT
            setattr(namespace, name, _routed(original, tpu_function, takes_device))
    _installed = True
