"""``python -m tpu_train.distributed.launch``: runs ranks, stops them all when one fails."""

import os
import subprocess
import sys
import time

import pytest

from tests.distributed.harness import ROOT
from tests.platforms import python_path

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split()[2] != "Z"


def _launch(args, tmp_path, timeout):
    env = dict(os.environ, PYTHONPATH=python_path(ROOT), TPU_TRAIN_PLATFORM="cpu",
               TPU_TRAIN_COLLECTIVE_TIMEOUT="60")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen([sys.executable, "-m", "tpu_train.distributed.launch", *args],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return proc.returncode, out


def test_launcher_runs_ddp(tmp_path):
    code, out = _launch(["--nproc", "2", "tests/distributed/workers/ddp_worker.py"], tmp_path, 150)
    assert code == 0, out[-3000:]
    assert out.count("RESULT ") == 2


def test_launcher_stops_everyone_when_a_rank_fails(tmp_path):
    start = time.monotonic()
    code, out = _launch(["--nproc", "3", "tests/distributed/workers/launch_victim.py",
                         str(tmp_path)], tmp_path, 120)
    assert code == 7, out[-3000:]
    assert "rank 1 exited with status 7" in out
    # well before the collective timeout (60 s): the launcher did not wait for it
    assert time.monotonic() - start < 55
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(3)]
    assert not [p for p in pids if _alive(p)], "orphaned rank processes"
