"""Run ``tpu-train`` in-process or as a subprocess with tiny, fast settings."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.platforms import cpu_child_env, python_path
from tpu_train import cli

ROOT = Path(__file__).resolve().parents[2]

# A debug_tiny Llama on 2 x 32-token batches, eager on the CPU: a step takes well under a
# second on one core and there is no compilation (several seconds per run).
_TINY_SHAPES = [
    "data.batch_size=2", "data.seq_len=32", "trainer.val_every_n_steps=0",
    "logging.progress_bar=false", "logging.every_n_steps=1", "checkpoint.export_hf=false",
    "scheduler.warmup_steps=1",
]
TINY = [*_TINY_SHAPES, "trainer.mode=eager", "trainer.device=cpu"]
# The same with the compiled step on the tpu device (the schema's default mode). The default
# parallel.data=-1 spreads it over the session's 8 virtual devices as data parallelism, so the
# global batch is 8 rows (one per device).
TINY_COMPILED = [*_TINY_SHAPES, "trainer.mode=compiled", "trainer.device=tpu",
                 "data.batch_size=8"]


@pytest.fixture
def one_thread():
    """Run the test with one intra-op thread (restored after).

    The tiny models of these tests gain nothing from more threads, and on a busy machine
    threads that wait for each other make every step several times slower.  One thread also
    makes the CPU arithmetic independent of the core count.
    """
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def run_in_process(*overrides: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``tpu-train overrides...`` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    saved_argv = sys.argv
    sys.argv = ["tpu-train", *overrides]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved_argv
    return code, out.getvalue(), err.getvalue()


def start_subprocess(*overrides: str, cwd: Path | None = None) -> subprocess.Popen:
    """``tpu-train`` in a child process (for signals) working in ``cwd``, output captured. A run
    on the host CPU (``trainer.device=cpu``) needs no chip, and on a TPU host this process holds
    it: that child runs on the cpu platform. A child on the tpu device runs on the test
    platform, as its parent's in-process runs do (a test that starts one on a chip is marked
    ``device_in_child``)."""
    variables = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if "trainer.device=cpu" in overrides:
        env = cpu_child_env(ROOT, **variables)
    else:
        env = dict(os.environ, PYTHONPATH=python_path(ROOT), **variables)
    return subprocess.Popen([sys.executable, "-m", "tpu_train.cli", *overrides], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _strict_constant(name: str):
    raise ValueError(f"metrics.jsonl is not strict JSON: it holds {name}")


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """The train record of each step of ``metrics.jsonl``, read as strict JSON (a resumed run
    truncates the rows after its step, so each step appears once); a non-finite value, written
    as ``null`` with a ``<key>_nonfinite`` flag, is read back as that float."""
    records: dict[int, dict] = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line, parse_constant=_strict_constant)
            for key in [k for k in record if k.endswith("_nonfinite")]:
                record[key[: -len("_nonfinite")]] = float(record.pop(key))
            if "train/loss" in record:
                records[record["step"]] = record
    return records


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under ``directory``: to prove nothing was written."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*"))}


def assert_one_line_out_of_memory(code: int, err: str) -> None:
    """A run whose train step did not fit (a ProgramOutOfMemoryError of 20 GiB against the
    v5e's 15.75) ended with exit 2 and one line naming both, no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert lines[-1].startswith("tpu-train: error: the compiled train step needs 20.00 GiB of "
                                "HBM per chip, which has 15.75 GiB; "), err
    assert "Traceback" not in err
