"""scripts/bench_eager.py --quick runs and prints one JSON line with every figure (never timings)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_eager_quick_prints_all_keys():
    env = dict(os.environ, TPU_TRAIN_PLATFORM="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_eager.py"), "--quick",
                           "--floor"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    for key in ("torch", "jax", "device", "jax_platform", "ops", "train_step", "repeats"):
        assert key in result, key
    assert result["device"].startswith("tpu")
    expected = {f"{op}_{size}" for op in ("add", "matmul", "softmax") for size in ("small", "medium")}
    assert set(result["ops"]) == expected
    for case in result["ops"].values():
        for side in ("tpu_eager_us", "jax_jit_us"):
            assert set(case[side]) == {"min", "median"}
            assert case[side]["min"] > 0
        assert "ratio_min" in case and "ratio_median" in case
    floor = result["floor"]
    assert set(floor) == {"jax_jit", "dispatch_only", "dispatch_new_tensor", "dispatch_jax_call",
                          "dispatch_jax_new_tensor", "tpu_add"}
    for case in floor.values():
        assert case["min"] > 0 and "ratio_min" in case and "ratio_median" in case
    step = result["train_step"]
    for side in ("tpu_eager_s", "torch_cpu_s"):
        assert set(step[side]) == {"min", "median"}
    assert "ratio_min" in step and "ratio_median" in step
