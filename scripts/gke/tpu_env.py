#!/usr/bin/env python3
"""Run a command with tpu_train's launch environment, worked out from the variables GKE gives
every pod of a multi-host TPU slice: for JobSets that this project does not render, such as
XPK's workloads.

    python3 /app/scripts/gke/tpu_env.py tpu-train recipe=llama_pretrain parallel.fsdp=-1 ...

GKE injects ``TPU_WORKER_ID`` (the pod's index in the slice) and ``TPU_WORKER_HOSTNAMES``
(every pod's host name, in index order) into the pods of an indexed Job that requests
``google.com/tpu`` on a multi-host slice. From them this sets what the TPU VM launcher gives each
worker (``tpu_train/distributed/pod.py``, ``job_environment``): ``RANK`` the worker id, worker
0's host name as ``MASTER_ADDR``, the host count as ``WORLD_SIZE``, and the run id from the
JobSet's name (the host names' domain), then replaces itself with the command. A variable
already set wins, so ``MASTER_PORT`` or ``TPU_TRAIN_RUN_ID`` can be chosen in the pod's spec.

On a multi-slice workload (XPK's ``--num-slices=N``) each pod also has ``MEGASCALE_NUM_SLICES``,
its ``MEGASCALE_SLICE_ID`` and ``MEGASCALE_COORDINATOR_ADDRESS`` (the host of slice 0's worker 0,
which libtpu joins the slices through), while ``TPU_WORKER_ID`` and ``TPU_WORKER_HOSTNAMES``
describe its own slice. The job then spans every slice: ``RANK`` is
``slice id * hosts per slice + worker id``, ``WORLD_SIZE`` the hosts of all slices, and
``MASTER_ADDR`` the MEGASCALE coordinator's host, whose domain (the JobSet's name) is the run id
every slice shares. Only the standard library is used.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "tpu_train_pod", HERE.parents[1] / "tpu_train" / "distributed" / "pod.py")
pod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pod)
PROG = "tpu_env"


class MissingGkeVariable(ValueError):
    """A variable GKE sets is missing or malformed: one line for the user."""


def launch_environment(environ: dict) -> dict:
    """The variables to add to ``environ`` (those it already has are left as they are)."""
    hostnames = [h.strip() for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if not hostnames:
        raise MissingGkeVariable(
            "TPU_WORKER_HOSTNAMES is not set: GKE sets it in the pods of a multi-host TPU slice "
            "(an indexed Job requesting google.com/tpu); elsewhere use scripts/launch_pod.sh or "
            "scripts/gke/render_jobset.py")
    worker = environ.get("TPU_WORKER_ID", "")
    if not worker.isdigit() or int(worker) >= len(hostnames):
        raise MissingGkeVariable(f"TPU_WORKER_ID={worker!r} must be a worker index below "
                                f"{len(hostnames)} (the host names in TPU_WORKER_HOSTNAMES)")
    num_slices, slice_id, coordinator = _slice_of(environ, default_coordinator=hostnames[0])
    # <jobset>-<job>-<i>-<j>.<subdomain>: JobSet's subdomain is the JobSet's name.
    run_id = coordinator.split(".")[1] if "." in coordinator else coordinator
    port = environ.get("MASTER_PORT", str(pod.DEFAULT_PORT))
    if not port.isdigit() or not 0 < int(port) < 65535:
        raise MissingGkeVariable(f"MASTER_PORT={port!r} must be a port number below 65535")
    rank = slice_id * len(hostnames) + int(worker)
    values = {"RANK": str(rank), **pod.job_environment(
        num_workers=num_slices * len(hostnames), coordinator=coordinator, port=int(port),
        run_id=run_id)}
    return {key: value for key, value in values.items() if key not in environ}


def _slice_of(environ: dict, default_coordinator: str) -> tuple[int, int, str]:
    """``(number of slices, this pod's slice id, the job's coordinator host)`` from the
    MEGASCALE variables of a multi-slice workload; one slice without them."""
    slices = environ.get("MEGASCALE_NUM_SLICES", "1").strip()
    if not slices.isdigit() or int(slices) < 1:
        raise MissingGkeVariable(f"MEGASCALE_NUM_SLICES={slices!r} must be a positive integer "
                                f"(the workload's slice count)")
    if int(slices) == 1:
        return 1, 0, default_coordinator
    slice_id = environ.get("MEGASCALE_SLICE_ID", "").strip()
    if not slice_id.isdigit() or int(slice_id) >= int(slices):
        raise MissingGkeVariable(f"MEGASCALE_SLICE_ID={slice_id!r} must be a slice index below "
                                f"{slices} (MEGASCALE_NUM_SLICES)")
    address = environ.get("MEGASCALE_COORDINATOR_ADDRESS", "").strip()
    host, colon, port = address.rpartition(":")
    host = host if colon and port.isdigit() else address  # the address may carry a port
    if not host or any(c in host for c in " /,:"):
        raise MissingGkeVariable(
            f"MEGASCALE_COORDINATOR_ADDRESS={address!r} must name slice 0's worker 0 (a host, "
            f"optionally with :port); XPK and JobSet set it on multi-slice workloads")
    return int(slices), int(slice_id), host


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        added = launch_environment(dict(os.environ))
    except MissingGkeVariable as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    os.environ.update(added)
    try:
        os.execvp(argv[0], argv)
    except OSError as error:
        print(f"{PROG}: error: cannot run {argv[0]!r}: {error.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
