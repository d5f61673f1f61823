"""Per-device distributed training: ``dist.init_process_group("tpu")`` over JAX collectives.

:func:`install` registers the ``tpu`` backend with torch.distributed and routes torch's
collective ops and FSDP2 for tpu tensors; ``import tpu_train`` calls it
(``tpu_train/api.py``, right after the ``tpu`` device is registered). Start-up
(``jax.distributed``) happens inside ``init_process_group``; see :mod:`.init`. Launch with
``torchrun``, ``torch.multiprocessing.spawn`` or ``python -m tpu_train.launch``.
"""

from tpu_train.distributed import dispatch_hooks, fsdp_compat
from tpu_train.distributed.health import CollectiveTimeoutError
from tpu_train.distributed.init import initialize
from tpu_train.distributed.process_group import BACKEND, TpuProcessGroup, register


def install() -> None:
    """Everything this package adds to torch and to the device layer (each idempotent): the
    ``tpu`` ProcessGroup backend, the c10d and functional-collective ops in the device's
    special-op table (:mod:`.dispatch_hooks`), and FSDP2's storage free/re-allocation for tpu
    tensors (:mod:`.fsdp_compat`), now if FSDP2 is imported, else when it is (an import hook:
    ``import tpu_train`` does not import FSDP2)."""
    register()
    dispatch_hooks.install()
    fsdp_compat.install_when_imported()


__all__ = ["BACKEND", "CollectiveTimeoutError", "TpuProcessGroup", "initialize", "install",
           "register"]
