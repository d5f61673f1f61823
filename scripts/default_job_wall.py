"""Where the default job's process wall time goes, cold: one JSON line.

Exact command (from the repository root; the tree whose ``tpu_train`` is timed is the current
directory, or ``--tree``)::

    python scripts/default_job_wall.py [--tree CHECKOUT] [--rounds 1] [-- OVERRIDES...]

Each round runs ``python -m tpu_train.cli run.dir=<fresh temporary> OVERRIDES`` in a fresh
process with ``TPU_TRAIN_CACHE_DIR=off`` (every program compiled cold) and reads its console as
it comes: seconds from the process's start to its first log line (imports, opening the device,
tokenizer, data, model), to the step-0 validation line (the first validation, its compiles), to
the "compiled the train step" line (printed after the first step), to the closing summary, and
to the end of the process (its exit); with the compile line, the exact match, the
summary's wall time and the process's host CPU time (user and system seconds, and their sum
over the wall time). The targets for the default job on a v5e chip: ``end`` <= 60 s, the
train step's compile <= 15 s, exact match >= 90 %, host CPU time <= 2x the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKS = (("first_log_line", "run dir: "), ("validated_step_0", "| validation |"),
         ("train_step_compiled", "the train step in"), ("summary", "finished step"))


def one_run(tree: Path, overrides: list[str]) -> dict:
    env = dict(os.environ, TPU_TRAIN_CACHE_DIR="off", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "tpu_train.cli", f"run.dir={directory}/run",
                   *overrides]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        seconds: dict[str, float] = {}
        lines = []
        for line in process.stdout:
            lines.append(line.rstrip())
            for key, text in MARKS:
                if key not in seconds and text in line:
                    seconds[key] = round(time.perf_counter() - started, 2)
        code = process.wait()
        seconds["end"] = round(time.perf_counter() - started, 2)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {"user_s": round(after.ru_utime - before.ru_utime, 1),
           "sys_s": round(after.ru_stime - before.ru_stime, 1)}
    cpu["over_wall"] = round((cpu["user_s"] + cpu["sys_s"]) / seconds["end"], 2)
    found = {key: next((line.strip() for line in lines if text in line), None)
             for key, text in (("compile_line", "the train step in"),
                               ("decoding_line", "validation decoding:"),
                               ("exact_match", "exact match "), ("summary_wall", "wall time:"))}
    if code != 0:
        found["output_tail"] = lines[-20:]
    return {"exit_status": code, "seconds": seconds, "cpu": cpu, **found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="the checkout whose tpu_train runs (default: this one)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="tpu-train overrides (after --)")
    args = parser.parse_args()
    runs = [one_run(args.tree.resolve(), args.overrides) for _ in range(args.rounds)]
    ends = [run["seconds"]["end"] for run in runs]
    compile_s = [float(m.group(1)) for run in runs if run["compile_line"]
                 for m in [re.search(r"the train step in ([0-9.]+) s", run["compile_line"])] if m]
    print(json.dumps({"tree": str(args.tree.resolve()), "overrides": args.overrides,
                      "end_s": ends, "train_step_compile_s": compile_s,
                      "load_average": os.getloadavg()[0], "runs": runs}))


if __name__ == "__main__":
    main()
