"""With the ``tpu`` extra (libtpu) installed on a host without a chip, choosing the CPU client
stays quiet: ``TPU_TRAIN_PLATFORM=cpu`` starts no TPU backend, so libtpu, which would look for
chips and write its warnings to stderr, is never loaded."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.platforms import without_runtime_start_up

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed (pip install tpu_train[tpu])")

FIRST_USE = """
import torch, tpu_train
from tpu_train.device import runtime
x = (torch.ones(2, device="tpu") + 1).cpu()
print(runtime.platform(), float(x.sum()))
"""


def test_cpu_platform_with_libtpu_installed_writes_nothing_to_stderr():
    env = dict(os.environ, TPU_TRAIN_PLATFORM="cpu")
    env.pop("JAX_PLATFORMS", None)
    proc = subprocess.run([sys.executable, "-c", FIRST_USE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["cpu", "4.0"]
    assert without_runtime_start_up(proc.stderr) == ""
