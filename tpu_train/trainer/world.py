"""The processes of a job: one, or several started by a launcher that train one model.

``torchrun``, ``python -m tpu_train.launch`` and ``scripts/launch_pod.sh`` say how many
processes there are through torch's launch environment (``WORLD_SIZE``, ``RANK``,
``MASTER_ADDR``, ``MASTER_PORT``). With more than one, :func:`start_processes` joins the
``tpu`` process group, which also starts ``jax.distributed``: it must run before anything
touches a device, because JAX fixes its device list when it creates its first backend.
"""

from __future__ import annotations

import dataclasses
import os

from .errors import ConfigError

WORLD_SIZE_ENV = "WORLD_SIZE"


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    size: int

    @property
    def is_main(self) -> bool:
        """Process 0 alone writes logs, metrics, TensorBoard, run files and the HF export."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def requested_world_size() -> int:
    """``WORLD_SIZE`` from the launcher (1 when unset); a bad value is the user's error."""
    raw = os.environ.get(WORLD_SIZE_ENV, "1")
    try:
        size = int(raw)
    except ValueError:
        raise ConfigError(f"{WORLD_SIZE_ENV}={raw!r} is not a number of processes; unset it or "
                          "launch with torchrun / python -m tpu_train.launch") from None
    if size < 1:
        raise ConfigError(f"{WORLD_SIZE_ENV}={size} must be >= 1")
    return size


def start_processes() -> World:
    """Join the job's process group when a launcher started several processes.

    Idempotent: a second call (e.g. the next job of a multirun) reuses the group.
    """
    import torch.distributed as dist

    size = requested_world_size()
    if size == 1:
        return World(0, 1)
    if not dist.is_initialized():
        import tpu_train.distributed  # noqa: F401  (registers the "tpu" backend)

        dist.init_process_group("tpu")
    return World(dist.get_rank(), dist.get_world_size())


def barrier(world: World) -> None:
    if world.distributed:
        import torch.distributed as dist

        dist.barrier()
