"""Per-device distributed training: ``dist.init_process_group("tpu")`` over JAX collectives.

``import tpu_train.distributed`` registers the ``tpu`` backend with torch.distributed. Start-up
(``jax.distributed``) happens inside ``init_process_group``; see :mod:`.init`. Launch with
``torchrun``, ``torch.multiprocessing.spawn`` or ``python -m tpu_train.launch``. FSDP2
(``fully_shard``) works on tpu tensors through :mod:`.fsdp_compat`, installed when FSDP2 is imported.
"""

from tpu_train.distributed import dispatch_hooks, fsdp_compat
from tpu_train.distributed.health import CollectiveTimeoutError
from tpu_train.distributed.init import initialize
from tpu_train.distributed.process_group import BACKEND, TpuProcessGroup, register

register()
dispatch_hooks.install()
# FSDP2 frees/re-allocates unsharded parameters by storage resize: route it for tpu tensors.
fsdp_compat.install_when_imported()

__all__ = ["BACKEND", "CollectiveTimeoutError", "TpuProcessGroup", "initialize", "register"]
