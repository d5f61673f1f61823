"""Start N worker processes on 127.0.0.1 like torchrun does, with a timeout and full clean-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.platforms import python_path
from tpu_train.distributed import ports

ROOT = Path(__file__).resolve().parents[2]


def free_port_pair() -> int:
    """A port P with P and P+1 free (torch's store on P, the JAX coordinator on P+1), drawn
    below the ephemeral range (tpu_train.distributed.ports) from this pytest-xdist worker's
    own slice of it, so two workers never draw the same port."""
    low, high = ports.drawing_range()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    width = (high - low + 1) // max(count, 1)
    return ports.free_port_pair((low + index * width, low + (index + 1) * width - 1))


def worker_env(rank: int, world: int, port: int, extra=None) -> dict:
    env = dict(os.environ)
    # One CPU device per process: each rank's tpu:0 is its own device.
    env.pop("XLA_FLAGS", None)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TPU_TRAIN_PLATFORM="cpu", PYTHONPATH=python_path(ROOT), PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_ranks(args, world: int, timeout: float, extra_env=None, per_rank_env=None):
    """Run ``python args...`` as ranks 0..world-1; returns [(returncode, output)] per rank.

    Every process gets its own session so that it and anything it starts can be killed; all
    are killed when the timeout passes or the caller fails.
    """
    port = free_port_pair()
    procs, logs = [], []
    try:
        for rank in range(world):
            env = worker_env(rank, world, port, extra_env)
            env.update((per_rank_env or {}).get(rank, {}))
            log = open(os.devnull if False else _log_path(rank, port), "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, *args], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=ROOT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        timed_out = any(p.poll() is None for p in procs)
    finally:
        kill_all(procs)
    results = []
    for p, log in zip(procs, logs):
        log.seek(0)
        results.append((None if timed_out and p.returncode in (-9,) else p.returncode,
                        log.read()))
        log.close()
        os.unlink(log.name)
    return results


def _log_path(rank: int, port: int) -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"tpu_dist_{port}_{rank}.log")
