"""Run ``tpu-train plan`` for the pod configurations of docs/parallelism.md and time them.

Usage: ``python scripts/measure_plans.py [--only NAME]`` (NAME: a key of ``COMMANDS``). For
each command prints the wall time, the CPU time of the command and its children, the load
average before and after, and the per-chip memory (analytic and XLA's analysis of the
compiled step) with the gap; last, one JSON line per command, with the verdict and the
predicted step time and MFU. Timings depend on the machine's load: report them with it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

# At 128 tokens a sequence, the figures docs/parallelism.md gives (the plan's own default is
# the model's context, at most 4,096); at 8,192 the pod plans set beside MaxText's published
# MFU (docs/benchmarks.md, "Planner"): the 8B as typed (float32, no remat: the plan compiles
# the setting that fits to check it) and both in bf16 with full remat; the 8B at 131,072
# tokens split over context (docs/parallelism.md).
_BF16_REMAT = ["trainer.precision=bf16", "trainer.remat=full"]
COMMANDS = {
    "8b": ["model=llama3_1_8b", "parallel.fsdp=256", "plan.chip=v5e", "data.seq_len=128"],
    "70b": ["model=llama3_1_70b", "parallel.fsdp=128", "plan.chip=v5p", "data.seq_len=128"],
    "8b_8k": ["model=llama3_1_8b", "data.seq_len=8192", "parallel.fsdp=256", "plan.chip=v5e"],
    "8b_8k_bf16": ["model=llama3_1_8b", "data.seq_len=8192", "parallel.fsdp=256",
                   "plan.chip=v5e", *_BF16_REMAT],
    "70b_8k_bf16": ["model=llama3_1_70b", "data.seq_len=8192", "parallel.fsdp=256",
                    "plan.chip=v5p", *_BF16_REMAT],
    "8b_131k": ["model=llama3_1_8b", "data.seq_len=131072", "data.batch_size=16",
                "parallel.context=16", "parallel.fsdp=16", "plan.chip=v5e", *_BF16_REMAT],
}
GiB = 1024 ** 3


def measure(overrides: list[str]) -> dict:
    before = os.getloadavg()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        output = os.path.join(folder, "plan.json")
        proc = subprocess.run([sys.executable, "-m", "tpu_train.cli", "plan", *overrides,
                               f"plan.output={output}"],
                              capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - start
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode:
            raise SystemExit(f"tpu-train plan {' '.join(overrides)} failed:\n"
                             f"{proc.stderr[-3000:]}")
        with open(output) as f:
            result = json.load(f)
    xla = result.get("xla", {})
    return {
        "command": "tpu-train plan " + " ".join(overrides),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu_after.ru_utime + cpu_after.ru_stime
                       - cpu_before.ru_utime - cpu_before.ru_stime, 1),
        "load_before": [round(x, 2) for x in before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "analytic_gib": round(result["bytes_total"] / GiB, 3),
        "xla_gib": round(xla["bytes_peak_estimate"] / GiB, 3) if "bytes_peak_estimate" in xla
        else None,
        "xla_vs_analytic_pct": round(100 * result["xla_vs_analytic"], 1)
        if "xla_vs_analytic" in result else None,
        "xla_source": xla.get("xla_source", xla.get("xla_error")),
        "xla_stage_seconds": xla.get("seconds"),
        "notes": result.get("notes"),
        "fits": result.get("fits"),
        "predicted_step_s": (xla.get("step_time") or {}).get("step_time_s"),
        "predicted_mfu": (xla.get("step_time") or {}).get("mfu"),
        "fitting_checked": [{k: f[k] for k in ("command", "checked_bytes", "checked_mfu")
                             if k in f} for f in result.get("fitting") or [] if f.get("checked")],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(COMMANDS))
    args = parser.parse_args()
    for name, overrides in COMMANDS.items():
        if args.only and name != args.only:
            continue
        m = measure(overrides)
        print(f"{m['command']}: {m['wall_s']} s wall, {m['cpu_s']} s CPU, load "
              f"{m['load_before'][0]} -> {m['load_after'][0]}; per chip analytic "
              f"{m['analytic_gib']} GiB, XLA {m['xla_gib']} GiB ({m['xla_vs_analytic_pct']} %)")
        print(json.dumps(m), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
