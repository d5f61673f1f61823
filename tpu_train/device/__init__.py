"""The ``tpu`` device: PJRT runtime through JAX, tensor/storage model, eager dispatch.

``import tpu_train`` registers it; after that ``torch.device("tpu:0")``, ``tensor.tpu()``,
``module.to("tpu")`` and ``torch.tpu.*`` work like their CUDA counterparts.
"""

from tpu_train.device.runtime import device_count, platform, runtime_info
from tpu_train.device.tensor import TpuTensor

__all__ = ["TpuTensor", "device_count", "platform", "runtime_info"]
