"""What ``import tpu_train`` gives: torch's ``tpu`` device backed by the PJRT devices JAX sees
(registered when this module is imported), the lowering table of its ops, the ``tpu``
ProcessGroup, and the package's functions.

``tpu_train/__init__.py`` imports it at once, except in the ``tpu-train`` command's own
process, which checks its configuration first, without torch or JAX, and then imports it
(:func:`tpu_train.startup.load_runtime`).
"""

from __future__ import annotations

from tpu_train import startup as _startup

# Before torch: a training command's backend opens while the rest is imported.
_startup.open_backend_early()

import torch  # noqa: E402

from tpu_train import ops  # noqa: E402,F401  (fills the lowering table)
from tpu_train.device import registration as _registration  # noqa: E402
from tpu_train.device import runtime as _runtime  # noqa: E402
from tpu_train.device.lazy import eager_mode  # noqa: E402
from tpu_train.device.runtime import runtime_info  # noqa: E402
from tpu_train.device.tensor import TpuTensor  # noqa: E402

# Everything ``import tpu_train`` registers with torch, in this one place: the ``tpu`` device
# (a misspelt TPU_TRAIN_PLATFORM fails at the first device use, runtime.platform(), not at
# import: importing must succeed so that the command line can report it as one line), then
# the ``tpu`` ProcessGroup with the collective ops' and FSDP2's routing for tpu tensors.
_registration.register()

from tpu_train import distributed as _distributed  # noqa: E402

_distributed.install()


def device(index: int | None = None) -> torch.device:
    """``torch.device("tpu:index")``; raises IndexError naming the valid range."""
    index = 0 if index is None else int(index)
    _runtime.jax_device(index)
    return torch.device("tpu", index)


def device_count() -> int:
    return _runtime.device_count()


__all__ = ["TpuTensor", "device", "eager_mode", "device_count", "runtime_info"]
