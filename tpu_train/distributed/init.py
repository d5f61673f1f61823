"""Start-up of the JAX distributed runtime from torch's launch environment.

Every process of a ``tpu`` job is one JAX process with one device (its own chip; on the CPU
client its own CPU device). The JAX coordination service must be started before JAX creates
its first backend in the process, so this module never touches a device itself and
:func:`initialize` runs lazily, from the ``tpu`` ProcessGroup creator, i.e. inside
``dist.init_process_group("tpu")`` and before the device runtime's first (cached) device query.

Where the settings come from, first match wins:

* explicit arguments to :func:`initialize`;
* torch's launch environment (torchrun, ``torch.multiprocessing.spawn`` scripts,
  ``python -m tpu_train.launch``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``. The JAX coordinator listens on ``MASTER_ADDR:MASTER_PORT+1`` (torch's
  TCPStore already owns ``MASTER_PORT``), or on a free port process 0 draws when that one is
  taken, announced through torch's store; ``TPU_TRAIN_JAX_COORDINATOR=host:port`` overrides;
* on a TPU VM without those variables: JAX's own cluster auto-detection (pod metadata).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading

from tpu_train.distributed import ports

COORDINATOR_ENV = "TPU_TRAIN_JAX_COORDINATOR"
TIMEOUT_ENV = "TPU_TRAIN_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
# Where process 0 tells the others the coordinator's address (in the world group's store).
COORDINATOR_KEY = "tpu_train/jax_coordinator"

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict = {"initialized": False, "rank": 0, "world_size": 1}


class DistributedInitError(RuntimeError):
    pass


def _backends_initialized() -> bool:
    from jax._src import xla_bridge

    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(probe()) if probe is not None else bool(getattr(xla_bridge, "_backends", {}))


def coordinator_address() -> str:
    """``host:port`` of the JAX coordination service derived from torch's environment."""
    explicit = os.environ.get(COORDINATOR_ENV)
    if explicit:
        return explicit
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT")
    if port is None:
        raise DistributedInitError(
            "MASTER_PORT is not set: launch with torchrun, python -m tpu_train.launch, or set "
            f"MASTER_ADDR/MASTER_PORT (or {COORDINATOR_ENV}=host:port) yourself")
    return f"{host}:{int(port) + 1}"


def agree_on_coordinator(rank: int, store=None) -> str:
    """The JAX coordination service's ``host:port``, the same in every process.

    ``TPU_TRAIN_JAX_COORDINATOR`` is used as given. Otherwise ``MASTER_ADDR:MASTER_PORT+1``
    when process 0 finds that port free; when it is taken (another job, or any outgoing
    connection on the host that drew it from the ephemeral range), process 0 listens on a
    port it draws instead and tells the others through torch's ``store``. Without a store a
    taken port is an error, raised before the JAX service would fail to bind it (which ends
    the process with a segfault, naming nothing).
    """
    explicit = os.environ.get(COORDINATOR_ENV)
    if rank != 0 and store is not None and not explicit:
        return store.get(COORDINATOR_KEY).decode()
    address = explicit or coordinator_address()
    source = f"{COORDINATOR_ENV}={explicit}" if explicit else "MASTER_PORT+1"
    host, _, port = address.rpartition(":")
    if not (host and port.isdigit() and 0 < int(port) < 65536):
        raise DistributedInitError(f"the JAX coordinator's address {address!r} ({source}) is "
                                   "not host:port with a port below 65536 (e.g. 10.0.0.2:8477)")
    if explicit or store is None:
        if rank == 0 and not ports.port_is_free(int(port)):
            raise DistributedInitError(
                f"port {port} for the JAX coordinator ({source}) is already in use on this "
                f"host: choose a free port (or another MASTER_PORT)")
        return address
    if not ports.port_is_free(int(port)):
        drawn = ports.free_port()
        log.warning("port %s (MASTER_PORT+1) is in use on this host; the JAX coordinator "
                    "listens on %d instead (set %s=host:port to fix one)", port, drawn,
                    COORDINATOR_ENV)
        address = f"{host}:{drawn}"
    store.set(COORDINATOR_KEY, address)
    return address


def collective_timeout(requested: datetime.timedelta | None = None) -> float:
    """Seconds a collective may wait for its peers before the lost ranks are reported.

    ``TPU_TRAIN_COLLECTIVE_TIMEOUT`` wins; a timeout passed to ``init_process_group`` is used
    as given, except torch's 30-minute default, which becomes 60 s: a dead peer should stop a
    job within a minute, not half an hour.
    """
    if os.environ.get(TIMEOUT_ENV):
        return float(os.environ[TIMEOUT_ENV])
    if requested is None:
        return DEFAULT_TIMEOUT_S
    seconds = requested.total_seconds()
    from torch.distributed.constants import default_pg_timeout

    if abs(seconds - default_pg_timeout.total_seconds()) < 1:
        return DEFAULT_TIMEOUT_S
    return seconds


def initialize(rank: int | None = None, world_size: int | None = None,
               local_rank: int | None = None, timeout_s: float | None = None,
               store=None) -> None:
    """Start ``jax.distributed`` once per process (idempotent; a 1-process job skips it).

    Raises a clear error when JAX already created its backends: from then on the process can
    no longer join a multi-process JAX world (create no ``tpu`` tensor before
    ``init_process_group``). ``store`` (torch's rendezvous store) lets the processes agree on
    the coordinator's port (:func:`agree_on_coordinator`).
    """
    with _lock:
        if _state["initialized"]:
            if world_size is not None and world_size != _state["world_size"]:
                raise DistributedInitError(
                    f"jax.distributed already runs with {_state['world_size']} processes; "
                    f"cannot start a {world_size}-process group")
            return
        import jax

        env = os.environ
        rank = int(env.get("RANK", 0)) if rank is None else rank
        world_size = int(env.get("WORLD_SIZE", 1)) if world_size is None else world_size
        local_rank = int(env.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
        try:
            # gloo carries cross-process collectives on the CPU client (the stand-in for ICI).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, ValueError):
            pass
        already = jax.distributed.is_initialized() if hasattr(jax.distributed, "is_initialized") \
            else False
        if world_size > 1 and not already:
            if _backends_initialized():
                raise DistributedInitError(
                    "JAX created its devices before dist.init_process_group('tpu'): create no "
                    "tpu tensor (and call no torch.tpu function) before init_process_group, so "
                    "that this process can join the multi-process JAX runtime")
            try:
                # Without it the JAX service terminates every process as soon as one task
                # disconnects, silently (no rank named); with it our timeout reports the loss.
                jax.config.update("jax_enable_recoverability", True)
            except (AttributeError, ValueError):
                pass
            # The JAX service's own liveness check must not beat ours: it aborts processes
            # without saying which peer is gone.
            heartbeat = int(max(100, 2 * (timeout_s or DEFAULT_TIMEOUT_S)))
            if "RANK" in env or "MASTER_PORT" in env or COORDINATOR_ENV in env:
                jax.distributed.initialize(
                    coordinator_address=agree_on_coordinator(rank, store),
                    num_processes=world_size,
                    process_id=rank, local_device_ids=[local_rank],
                    heartbeat_timeout_seconds=heartbeat)
            else:
                jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
        _state.update(initialized=True, rank=rank, world_size=world_size)


def is_initialized() -> bool:
    return _state["initialized"]
