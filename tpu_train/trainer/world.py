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

from tpu_train.distributed.init import TIMEOUT_ENV
from tpu_train.startup import WORLD_SIZE_ENV

from .errors import ConfigError

_LAUNCHERS = "torchrun or python -m tpu_train.launch"


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


def _integer_env(name: str, low: int, high: int) -> None:
    raw = os.environ.get(name)
    if raw is None:
        raise ConfigError(f"{WORLD_SIZE_ENV}={os.environ[WORLD_SIZE_ENV]} but {name} is not set; "
                          f"start the processes with {_LAUNCHERS} (they set it)")
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ConfigError(f"{name}={raw!r} must be an integer in [{low}, {high}]; start the "
                          f"processes with {_LAUNCHERS}")


def check_launch_environment(size: int) -> None:
    """The launch variables ``init_process_group`` reads, checked so that a hand-set or partial
    environment is one line naming the variable rather than a rendezvous traceback."""
    _integer_env("RANK", 0, size - 1)
    if not os.environ.get("MASTER_ADDR"):
        raise ConfigError(f"{WORLD_SIZE_ENV}={size} but MASTER_ADDR is not set; start the "
                          f"processes with {_LAUNCHERS}")
    _integer_env("MASTER_PORT", 1, 65535)
    raw_timeout = os.environ.get(TIMEOUT_ENV)
    if raw_timeout is not None:
        try:
            ok = float(raw_timeout) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"{TIMEOUT_ENV}={raw_timeout!r} must be a positive number of "
                              "seconds; unset it for the default")


def start_processes() -> World:
    """Join the job's process group when a launcher started several processes.

    Idempotent: a second call (e.g. the next job of a multirun) reuses the group.
    """
    import torch.distributed as dist

    size = requested_world_size()
    if size == 1:
        return World(0, 1)
    if not dist.is_initialized():
        check_launch_environment(size)
        # The "tpu" backend: registered by ``import tpu_train`` (tpu_train.distributed.install).
        dist.init_process_group("tpu")
    return World(dist.get_rank(), dist.get_world_size())


def barrier(world: World) -> None:
    if world.distributed:
        import torch.distributed as dist

        dist.barrier()
