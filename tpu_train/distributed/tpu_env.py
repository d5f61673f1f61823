"""libtpu's environment for one process per TPU chip (what the launcher sets on a TPU VM).

By default libtpu opens every chip of the host in the first process that loads it and refuses
a second process. To give each process its own chip, as ``torch.distributed`` code expects
(``tpu:0`` is this process's chip), each process must be told which chip it owns and where the
other processes of the slice are:

``TPU_VISIBLE_CHIPS``             the local chip index this process owns
``TPU_CHIPS_PER_PROCESS_BOUNDS``  ``1,1,1``: one chip per process
``TPU_PROCESS_BOUNDS``            the grid of processes over the whole slice (x,y,z)
``TPU_PROCESS_PORT``              the port libtpu listens on for this process
``TPU_PROCESS_ADDRESSES``         ``host:port`` of every process of the slice, in process order
``CLOUD_TPU_TASK_ID``             this process's index in that list (its global rank)
``ALLOW_MULTIPLE_LIBTPU_LOAD``    lets several processes of one host load libtpu

The grid of one-chip processes on one host is the one JAX's own multi-process test launcher
uses (``jax/_src/test_multiprocess.py``): 1 chip ``1,1,1``, 2 chips ``2,1,1``, 4 chips ``2,2,1``,
8 chips ``4,2,1``. Across hosts the process grid is the host grid times the per-host grid
(as torch_xla sets it: 4 chips per host on 2 hosts is ``2,2,2``); the host grid cannot be guessed from a host count (a 4-host slice may be
``1,1,4`` or ``2,2,1``), so a multi-host launch takes it from the TPU VM's metadata
(``TPU_HOST_BOUNDS``) or from ``--tpu-host-bounds``, and each host's address from
``TPU_WORKER_HOSTNAMES`` (set on TPU VMs) or ``--tpu-worker-hosts``.

Variables the user already set are left alone; the launcher adds this environment only when
the host has TPU chips or ``--tpu-env on`` asks for it.
"""

from __future__ import annotations

from tpu_train.device import tpu_host

LIBTPU_BASE_PORT = 8476
PROCESSES_PER_HOST_BOUNDS = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1), 8: (4, 2, 1)}
_VARIABLES = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS",
              "TPU_PROCESS_PORT", "TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID",
              "ALLOW_MULTIPLE_LIBTPU_LOAD")


class TpuEnvError(ValueError):
    pass


def host_has_tpu_chips() -> bool:
    """TPU chips on the PCI bus or as device files (:mod:`tpu_train.device.tpu_host`)."""
    return bool(tpu_host.hardware_evidence())


def parse_bounds(text: str, what: str) -> tuple[int, int, int]:
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise TpuEnvError(f"{what}={text!r} is not three positive integers like '2,2,1'")
    return values  # type: ignore[return-value]


def _fmt(bounds) -> str:
    return ",".join(str(b) for b in bounds)


def processes_per_host_bounds(nproc: int) -> tuple[int, int, int]:
    try:
        return PROCESSES_PER_HOST_BOUNDS[nproc]
    except KeyError:
        raise TpuEnvError(
            f"--nproc {nproc}: one process per TPU chip needs 1, 2, 4 or 8 processes per host "
            f"(the chip counts of TPU VMs); use --nproc equal to the host's chip count, or run "
            f"one process per host (--nproc 1) and shard over its chips with parallel.*") from None


def slice_env(*, nproc: int, nnodes: int, node_rank: int, local_rank: int,
              host_bounds: str | None = None, worker_hosts: str | None = None,
              base_port: int = LIBTPU_BASE_PORT) -> dict[str, str]:
    """The libtpu variables for local process ``local_rank`` of host ``node_rank``."""
    per_host = processes_per_host_bounds(nproc)
    if nnodes == 1:
        hosts_grid = (1, 1, 1)
        hosts = ["localhost"]
    else:
        if not host_bounds:
            raise TpuEnvError(
                f"{nnodes} hosts with one process per chip: the host grid is unknown; pass "
                f"--tpu-host-bounds x,y,z (TPU VMs set TPU_HOST_BOUNDS in the environment)")
        hosts_grid = parse_bounds(host_bounds, "TPU host bounds")
        if hosts_grid[0] * hosts_grid[1] * hosts_grid[2] != nnodes:
            raise TpuEnvError(f"TPU host bounds {host_bounds!r} describe "
                              f"{hosts_grid[0] * hosts_grid[1] * hosts_grid[2]} hosts, "
                              f"but --nnodes is {nnodes}")
        if not worker_hosts:
            raise TpuEnvError(
                f"{nnodes} hosts with one process per chip: every host's address is needed; "
                f"pass --tpu-worker-hosts h0,h1,... (TPU VMs set TPU_WORKER_HOSTNAMES)")
        hosts = [h.strip() for h in worker_hosts.split(",") if h.strip()]
        if len(hosts) != nnodes:
            raise TpuEnvError(f"{len(hosts)} TPU worker hosts given ({worker_hosts!r}) for "
                              f"--nnodes {nnodes}")
    process_bounds = tuple(a * b for a, b in zip(per_host, hosts_grid))
    addresses = [f"{host}:{base_port + i}" for host in hosts for i in range(nproc)]
    return {
        "TPU_VISIBLE_CHIPS": str(local_rank),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": _fmt(process_bounds),
        "TPU_PROCESS_PORT": str(base_port + local_rank),
        "TPU_PROCESS_ADDRESSES": ",".join(addresses),
        "CLOUD_TPU_TASK_ID": str(node_rank * nproc + local_rank),
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }


def apply(env: dict, values: dict[str, str]) -> dict:
    """``env`` with ``values`` added, except where the user already set a libtpu variable:
    then the user's placement wins whole (mixing the two would name chips inconsistently)."""
    if any(name in env for name in _VARIABLES[:5]):
        return env
    return {**env, **values}
