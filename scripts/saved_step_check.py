"""Run one job twice: with a saved train step (``compile.executable=PATH``) and compiling it;
print one JSON line: whether their losses agree (bitwise, or the largest difference) and where
each run's start-up went (``startup/*``: trace, lower, XLA compile, cache read, executable load).

    python scripts/saved_step_check.py --executable step.xla -- data.batch_size=2 data.seq_len=32 ...

The executable is written beforehand by the same overrides and ``compile.save_executable=PATH``
(on this host, or on any host with ``compile.target=v5e:1x1`` for a v5e chip). Both runs use
``TPU_TRAIN_CACHE_DIR=off``, so the second really compiles. Exit status 1 when the losses differ
or the loaded run compiled its step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _run(overrides: list[str], run_dir: Path) -> dict:
    env = dict(os.environ, TPU_TRAIN_CACHE_DIR="off")
    proc = subprocess.run([sys.executable, "-m", "tpu_train.cli", *overrides, f"run.dir={run_dir}"],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"tpu-train exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    losses = [row["train/loss"] for row in rows if "train/loss" in row]
    startup = next((({k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("startup/")})
                    for row in rows if any(k.startswith("startup/") for k in row)), {})
    closing = [line for line in proc.stdout.splitlines() if "train step start-up:" in line]
    return {"losses": losses, "startup": startup, "closing_row": closing[-1].strip() if closing
            else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executable", required=True, help="what compile.save_executable wrote")
    parser.add_argument("overrides", nargs="*", help="the job's tpu-train overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="saved-step-") as work:
        loaded = _run([*args.overrides, f"compile.executable={args.executable}"],
                      Path(work) / "loaded")
        compiled = _run(args.overrides, Path(work) / "compiled")
    pairs = list(zip(loaded["losses"], compiled["losses"]))
    differences = [abs(a - b) for a, b in pairs]
    result = {"steps": len(pairs), "bitwise_equal": loaded["losses"] == compiled["losses"],
              "max_loss_difference": max(differences, default=None),
              "loaded": loaded, "compiled": compiled}
    print(json.dumps(result))
    ok = result["bitwise_equal"] or (pairs and max(differences) <= 1e-6)
    return 0 if ok and loaded["startup"].get("xla_compile_s") == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
