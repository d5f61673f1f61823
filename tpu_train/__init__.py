"""tpu_train: PyTorch-native training on TPUs (and any PJRT device) through JAX.

``import tpu_train`` makes ``tpu`` a PyTorch device backed by the PJRT devices JAX sees
(libtpu on a TPU VM, the CUDA plugin on a GPU host, the CPU client elsewhere; choose with
``TPU_TRAIN_PLATFORM=tpu|cuda|cpu``)::

    import torch, tpu_train
    x = torch.randn(32, 4096, device=tpu_train.device(0))
"""

from __future__ import annotations

import os as _os

from tpu_train import startup as _startup


def _quiet_xla_for_the_command_line() -> None:
    """``tpu-train`` (also ``python -m tpu_train.cli`` under a launcher) keeps XLA's C++
    warnings off the console unless ``logging.verbose=true`` is on its command line: jaxlib reads
    ``TF_CPP_MIN_LOG_LEVEL`` once, when it is imported, which is here, before the command's own
    code runs (``tpu_train.trainer.log_noise`` does the rest). A value already set wins."""
    args = _startup.command_arguments()
    if args is not None and "logging.verbose=true" not in (arg.lower() for arg in args):
        _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


_quiet_xla_for_the_command_line()
# Before torch: a training command's backend opens while the rest is imported.
_startup.open_backend_early()

import torch  # noqa: E402

from tpu_train import ops  # noqa: F401  (fills the lowering table)
from tpu_train.device import registration as _registration
from tpu_train.device.lazy import eager_mode
from tpu_train.device import runtime as _runtime
from tpu_train.device.runtime import runtime_info
from tpu_train.device.tensor import TpuTensor

__version__ = "0.1.0"

# A misspelt TPU_TRAIN_PLATFORM fails at the first device use (runtime.platform()), not at
# import: importing must succeed so that the command line can report it as one line.
_registration.register()

from tpu_train import distributed as _distributed  # noqa: E402,F401  (the "tpu" ProcessGroup)


def device(index: int | None = None) -> torch.device:
    """``torch.device("tpu:index")``; raises IndexError naming the valid range."""
    index = 0 if index is None else int(index)
    _runtime.jax_device(index)
    return torch.device("tpu", index)


def device_count() -> int:
    return _runtime.device_count()


__all__ = ["TpuTensor", "device", "eager_mode", "device_count", "runtime_info", "__version__"]
