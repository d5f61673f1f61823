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


__version__ = "0.1.0"
__all__ = ["TpuTensor", "device", "eager_mode", "device_count", "runtime_info", "__version__"]

_quiet_xla_for_the_command_line()

if _startup.command_arguments() is None:
    from tpu_train.api import TpuTensor, device, device_count, eager_mode, runtime_info
else:
    # ``tpu-train`` composes and checks its configuration before torch and JAX are imported
    # (a typo or a bad value is answered in well under a second of CPU), then imports the
    # rest (tpu_train.startup.load_runtime) before anything runs on a device.
    def __getattr__(name: str):
        if name not in __all__:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        _startup.load_runtime()
        return globals()[name]
