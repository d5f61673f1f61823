"""What ``import tpu_train`` costs next to importing its two big dependencies.

Exact command (from the repository root)::

    python scripts/bench_import.py              # --repeats 7
    python scripts/bench_import.py --tree OTHER_CHECKOUT   # also time another tree's tpu_train

Each repeat starts fresh interpreters, interleaved: ``import torch``, ``import jax``, ``import
torch, jax`` (the floor any torch-on-JAX package pays) and ``import tpu_train`` (with
``--tree``, also ``import tpu_train`` from that checkout: a before/after comparison in one run).
Wall seconds per interpreter, from start to exit. One JSON line: min and median per case, the
ratio of ``tpu_train`` to the floor, and which optional parts of torch ``import tpu_train``
loaded (dynamo, DTensor, FSDP2: parts only some programs use).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp")


def _time(code: str, tree: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tree,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _summary(samples: list[float]) -> dict:
    return {"min": round(min(samples), 3), "median": round(statistics.median(samples), 3)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tree", type=Path, help="another checkout whose tpu_train is timed too")
    args = parser.parse_args(argv)
    if args.tree is not None and not (args.tree / "tpu_train" / "__init__.py").is_file():
        parser.error(f"--tree {args.tree}: no tpu_train package there; give a checkout's root")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give at least 1")
    cases = {"torch": ("import torch", ROOT), "jax": ("import jax", ROOT),
             "torch_and_jax": ("import torch, jax", ROOT),
             "tpu_train": ("import tpu_train", ROOT)}
    if args.tree is not None:
        cases["tpu_train_other_tree"] = ("import tpu_train", args.tree.resolve())
    samples = {name: [] for name in cases}
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for name, (code, tree) in cases.items():
            samples[name].append(_time(code, tree))
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys, tpu_train; print([m for m in {OPTIONAL!r} "
         "if m in sys.modules])"], check=True, capture_output=True, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout.strip()
    summaries = {name: _summary(values) for name, values in samples.items()}
    floor = summaries["torch_and_jax"]
    report = {
        "benchmark": "bench_import", "repeats": args.repeats, "seconds": summaries,
        "tpu_train_over_torch_and_jax": {
            k: round(summaries["tpu_train"][k] / floor[k], 2) for k in ("min", "median")},
        "optional_torch_parts_loaded": loaded, "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    if args.tree is not None:
        other = summaries["tpu_train_other_tree"]
        report["other_tree_over_this"] = {
            k: round(other[k] / summaries["tpu_train"][k], 2) for k in ("min", "median")}
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
