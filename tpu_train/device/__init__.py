"""The ``tpu`` device: PJRT runtime through JAX, tensor/storage model, eager dispatch.

``import tpu_train`` registers it; after that ``torch.device("tpu:0")``, ``tensor.tpu()``,
``module.to("tpu")`` and ``torch.tpu.*`` work like their CUDA counterparts.
"""

from tpu_train.device.runtime import device_count, platform, runtime_info
from tpu_train.device.tensor import TpuTensor, owns_whole_storage, storage_of, write_elements

__all__ = ["TpuTensor", "device_count", "owns_whole_storage", "platform", "runtime_info",
           "storage_of", "write_elements"]
