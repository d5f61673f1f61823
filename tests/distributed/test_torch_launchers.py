"""The tpu ProcessGroup under ``torch.multiprocessing.spawn`` and ``torchrun`` (2 ranks)."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from tests.distributed.harness import ROOT, free_port_pair
from tests.platforms import python_path
from tests.tolerances import rtol_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]

WORLD = 2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split()[2] != "Z"


def _run(args, piddir, port, timeout=150):
    """Run ``python args...`` in its own session; kill it and every rank it recorded after."""
    env = dict(os.environ, PYTHONPATH=python_path(ROOT), TPU_TRAIN_PLATFORM="cpu",
               TPU_TRAIN_COLLECTIVE_TIMEOUT="60", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    for name in ("XLA_FLAGS", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = "timed out"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # torchrun starts each rank in a session of its own: kill those by their recorded pid
        pids = [int(p.read_text()) for p in piddir.glob("pid-*")]
        leftovers = [p for p in pids if _alive(p)]
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    results = [json.loads(p.read_text()) for p in piddir.glob("result-*.json")]
    return proc.returncode, out, results, pids, leftovers


def _check(code, out, results, pids, leftovers, launcher):
    assert code == 0, out[-4000:]
    assert sorted(r["rank"] for r in results) == list(range(WORLD)), out[-4000:]
    for r in results:
        assert r["launcher"] == launcher and r["world"] == WORLD and r["backend"] == "tpu", r
        assert r["all_reduce_ok"], r
        # One float32 backward of Linear(6, 3) on 4 rows (longest reduction: the MSE over
        # 4 x 3 = 12 outputs), then averaged over the ranks (a second reduction).
        assert r["grad_rel"] < rtol_for(torch.float32, 12, depth=2), r
    assert len(pids) == WORLD and not leftovers, "rank processes outlived the launcher"


def test_multiprocessing_spawn(tmp_path):
    port = free_port_pair()
    _check(*_run(["tests/distributed/workers/launch_worker.py", "spawn", str(tmp_path),
                  str(WORLD)], tmp_path, port), "spawn")


def test_torchrun_with_the_port_after_master_port_taken(tmp_path):
    """torchrun draws MASTER_PORT from the ephemeral range, where an outgoing connection can
    hold MASTER_PORT+1, the JAX coordinator's default: rank 0 then listens on a port it draws
    and tells the other ranks through torch's store (JAX's service would segfault otherwise).
    The spawn test above covers the default port."""
    port = free_port_pair()
    with socket.socket() as taken:
        # As free_port_pair judged it free: a connection of an earlier test may still hold the
        # port in TIME_WAIT, which only a socket with SO_REUSEADDR can bind over.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        code, out, *rest = _run(["-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                                 "--master-addr", "127.0.0.1", "--master-port", str(port),
                                 "tests/distributed/workers/launch_worker.py", "torchrun",
                                 str(tmp_path)], tmp_path, port)
    _check(code, out, *rest, "torchrun")
    assert f"port {port + 1} (MASTER_PORT+1) is in use on this host" in out, out[-4000:]
