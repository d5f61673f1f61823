"""Shared (tied) parameters stay one parameter when a module moves to the ``tpu`` device.

``nn.Module._apply`` (behind ``.to()``, ``.tpu()``, ``.half()``, ``.to_empty()``) keeps a
parameter object only when ``torch._has_compatible_shallow_copy_type(old, new)`` holds, i.e.
when ``param.data = new`` can swap the C++ implementation in place. That is true between CPU
and CUDA tensors but never between a CPU tensor and a Python wrapper subclass such as
``TpuTensor``, so ``_apply`` gives every module a *new* Parameter: a weight shared by two
modules (GPT-2's tied embedding and LM head, any ``tie_word_embeddings=True``) becomes two
parameters that train apart, silently. On CUDA the shared object is converted in place and
stays shared.

PyTorch offers no hook around ``_apply`` (its parameter-registration hooks are not called
there), so :func:`install` wraps ``nn.Module._apply`` once: the outermost call notes which
parameter objects sit in which (module, name) slots, runs the original, and where one old
parameter became several new ``tpu`` parameters, puts the first of them in every slot that
shared it (likewise for moves from tpu back to the CPU). Conversions that neither start nor
end on the tpu device are left exactly as PyTorch made them.

The same wrapper lets a module's host-to-device transfers overlap: no weight reaches user code
before ``_apply`` returns, so each is transferred from its own memory and all are waited for
once at the end (:func:`tpu_train.device.storage.host_reads_awaited_on_exit`).
"""

from __future__ import annotations

import threading

import torch

from tpu_train.device import storage
from tpu_train.device.tensor import TpuTensor

_local = threading.local()
_original_apply = None


def _slots(module: torch.nn.Module) -> list:
    """(module, name, parameter) for every parameter slot under ``module``, shared ones included."""
    return [(owner, name, param) for owner in module.modules(remove_duplicate=False)
            for name, param in owner._parameters.items() if param is not None]


def _retie(slots: list) -> None:
    """Where one old parameter now maps to several new parameters and the move was to or
    from the tpu device, keep the first."""
    replacement: dict = {}
    for owner, name, old in slots:
        new = owner._parameters.get(name)
        if new is None or new is old or not isinstance(new, TpuTensor) and not isinstance(old, TpuTensor):
            continue
        kept = replacement.setdefault(id(old), new)
        if kept is not new:
            owner._parameters[name] = kept


def _apply(self, fn, recurse=True):
    if getattr(_local, "depth", 0) or not recurse:
        return _original_apply(self, fn, recurse)
    slots = _slots(self)  # holds the old parameters alive, so their ids stay unique
    _local.depth = 1
    try:
        # The module's host tensors reach user code again only when this returns: their
        # transfers overlap, and are waited for once.
        with storage.host_reads_awaited_on_exit():
            result = _original_apply(self, fn, recurse)
    finally:
        _local.depth = 0
    _retie(slots)
    return result


def install() -> None:
    """Wrap ``nn.Module._apply`` (idempotent)."""
    global _original_apply
    if _original_apply is not None:
        return
    _original_apply = torch.nn.Module._apply
    _apply.__doc__ = _original_apply.__doc__
    _apply.__wrapped__ = _original_apply
    torch.nn.Module._apply = _apply
