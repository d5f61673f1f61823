"""The ``tpu`` device: PJRT runtime through JAX, tensor/storage model, eager dispatch.

``import tpu_train`` registers it; after that ``torch.device("tpu:0")``, ``tensor.tpu()``,
``module.to("tpu")`` and ``torch.tpu.*`` work like their CUDA counterparts.

The tensor model's names load on first use: ``tpu-train`` opens the backend through
:mod:`tpu_train.device.runtime` before torch is imported (:mod:`tpu_train.startup`).
"""

import importlib

from tpu_train.device.runtime import device_count, platform, runtime_info

_FROM_TENSOR = ("TpuTensor", "owns_whole_storage", "storage_of", "write_elements")

__all__ = ["TpuTensor", "device_count", "owns_whole_storage", "platform", "runtime_info",
           "storage_of", "write_elements"]


def __getattr__(name: str):
    if name in _FROM_TENSOR:
        return getattr(importlib.import_module(f"{__name__}.tensor"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
