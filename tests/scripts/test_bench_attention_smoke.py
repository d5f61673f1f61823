"""scripts/bench_attention.py runs where no TPU is and prints one JSON line: the XLA form's
figures, the kernels' left out (or, with --interpret, run in Pallas' interpret mode and giving
the XLA form's gradients). Never a timing assertion."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.ops.test_attention import tolerance

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    env = dict(os.environ, TPU_TRAIN_PLATFORM="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_attention.py"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc


def test_bench_attention_on_the_cpu_client():
    proc = _run("--rounds", "2", "--shapes", "1x2(1)x128", "--interpret")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    assert result["platform"] == "cpu" and result["splash"].startswith("interpret mode")
    (shape,) = result["shapes"]
    assert shape["shape"] == "1x2(1)x128" and shape["rule_takes_kernels"] is False
    for form in ("xla_ms", "splash_ms"):
        assert shape[form]["min"] > 0 and shape[form]["median"] >= shape[form]["min"]
    # The two forms' bf16 gradients, as tests/ops/test_attention_tpu.py bounds each against
    # PyTorch (a normwise difference sits well inside that elementwise bound).
    bound = tolerance(torch.bfloat16, 128, 6, 6, 1.0)["rtol"]
    assert max(shape["grad_relative_difference"].values()) <= bound


def test_bench_attention_without_a_tpu_reports_no_kernel_figures():
    proc = _run("--rounds", "1", "--shapes", "1x2(1)x128")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (shape,) = result["shapes"]
    assert shape["splash_ms"] is None and shape["xla_over_splash"] is None
    assert result["splash"].startswith("not run")


def test_a_bad_shape_is_one_line():
    proc = _run("--shapes", "8x16x1024")
    assert proc.returncode == 2
    assert "--shapes: shape '8x16x1024' is not BxH(KV)xS" in proc.stderr


def test_bench_attention_with_document_masks():
    """``--documents``: packed rows' document masks, the kernels (interpret mode) with segment
    ids giving the XLA form's dense-mask gradients."""
    proc = _run("--rounds", "1", "--shapes", "2x2(1)x256", "--documents", "3", "--interpret")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["documents_per_row"] == 3
    (shape,) = result["shapes"]
    bound = tolerance(torch.bfloat16, 256, 6, 6, 1.0)["rtol"]
    assert max(shape["grad_relative_difference"].values()) <= bound
