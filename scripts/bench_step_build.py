#!/usr/bin/env python
"""What building W1's compiled step costs, per torch optimizer: trace, lower and XLA seconds.

Each round builds the step in a fresh process (no persistent cache: ``TPU_TRAIN_CACHE_DIR=off``)
for every optimizer named, the optimizers interleaved round by round, and times its first
call: the step traced (the model's forward and the optimizer's ``step()``), lowered to
StableHLO, compiled by XLA, run once. ``adamw`` takes the hand-written update; the others
(``nadam``, ``radam``, ``adamax``) the traced path that any ``torch.optim`` optimizer takes
(docs/compile.md), whose bias corrections raise each beta to the step count per parameter.
Prints ONE JSON line: per optimizer the min / median of each stage over the rounds, and the
first loss (the same model and batch for all). Usage::

    python scripts/bench_step_build.py [--optimizers adamw,nadam] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OPTIMIZERS = {"adamw": "AdamW", "nadam": "NAdam", "radam": "RAdam", "adamax": "Adamax"}
STAGES = ("first_call_s", "trace_s", "lower_s", "xla_s")


def build_once(name: str) -> dict:
    """In this process: W1 on the device, the optimizer, the compiled step's first call."""
    import torch

    import bench_train_step as w1
    import tpu_train
    from tpu_train.compile import compile_train_step
    from tpu_train.models import Llama

    torch.manual_seed(0)
    device = tpu_train.device(0)
    model = Llama(w1.w1_config()).to(device)
    optimizer = getattr(torch.optim, OPTIMIZERS[name])(model.parameters(), lr=1e-3)
    step = compile_train_step(model, optimizer, w1.lm_loss)
    batch = {k: torch.from_numpy(v).to(device) for k, v in w1.make_batches(1, 8192)[0].items()}
    start = time.perf_counter()
    loss = float(step(batch)["loss"])
    records = step.compilations
    return {"first_call_s": time.perf_counter() - start,
            "trace_s": sum(r.trace_s for r in records),
            "lower_s": sum(r.lower_s for r in records),
            "xla_s": sum(r.compile_s for r in records), "loss": loss}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", default="adamw,nadam",
                        help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=tuple(OPTIMIZERS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(build_once(args.child)))
        return {}
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    names = [n for n in args.optimizers.split(",") if n]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown or not names:
        parser.error(f"--optimizers {args.optimizers!r}: unknown or none {unknown}; choose from "
                     f"{', '.join(OPTIMIZERS)}")
    env = dict(os.environ, TPU_TRAIN_CACHE_DIR="off")
    runs: dict = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            done = subprocess.run([sys.executable, __file__, "--child", name], env=env,
                                  capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    report = {"benchmark": "step_build", "rounds": args.rounds}
    for name, rows in runs.items():
        report[name] = {stage: [round(min(r[stage] for r in rows), 3),
                                round(statistics.median(r[stage] for r in rows), 3)]
                        for stage in STAGES}
        report[name]["loss"] = rows[0]["loss"]
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
