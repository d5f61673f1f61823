"""What ``tpu-train`` costs before it answers: ``--help``, a misspelt key and bad values.

Exact command (from the repository root)::

    python scripts/bench_cli_startup.py                 # --repeats 7
    python scripts/bench_cli_startup.py --tree OTHER_CHECKOUT   # also time another tree's CLI

Each repeat runs every case once in a fresh child process, interleaved:
``python -m tpu_train.cli ARGS`` (what the ``tpu-train`` console script runs) with this
checkout first on ``PYTHONPATH``, and with ``--tree`` the same from that checkout (a before /
after comparison in one run). Per child: CPU seconds (user + system, from ``os.wait4``'s
resource usage of that child alone) and wall seconds from start to exit. Every child's exit
status and the last line of its output are checked against the case's expected answer, so a
figure is never that of a command that failed some other way. One JSON line: min and median per
case, and the load average before and after (CPU time is less sensitive to other work on the
host than wall time, but not immune: a loaded host's caches and frequency still move it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (arguments, expected exit status, text the last line of output must hold)
CASES = {
    "help": (["--help"], 0, "A run directory that already holds a checkpoint is resumed"),
    "typo": (["trainer.max_step=10"], 2, "tpu-train: error: unknown key 'trainer.max_step'"),
    "bad_type": (["trainer.max_steps=many"], 2,
                 "tpu-train: error: bad value for 'trainer.max_steps'"),
    "bad_value": (["optim.lr=-1"], 2, "tpu-train: error: optim.lr must be > 0, got -1.0"),
}


def _run_child(args: list[str], tree: Path) -> tuple[float, float, int, str]:
    """(CPU seconds, wall seconds, exit status, last output line) of one ``tpu-train args``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("WORLD_SIZE", None)
    with tempfile.TemporaryFile("w+") as output:
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "tpu_train.cli", *args], cwd=tree,
                                 env=env, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        output.seek(0)
        lines = output.read().strip().splitlines()
    return usage.ru_utime + usage.ru_stime, wall, child.returncode, lines[-1] if lines else ""


def _summary(samples: list[float]) -> dict:
    return {"min": round(min(samples), 3), "median": round(statistics.median(samples), 3)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tree", type=Path, help="another checkout whose CLI is timed too")
    args = parser.parse_args(argv)
    if args.tree is not None and not (args.tree / "tpu_train" / "cli.py").is_file():
        parser.error(f"--tree {args.tree}: no tpu_train/cli.py there; give a checkout's root")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give at least 1")
    trees = {"this": ROOT} | ({"other": args.tree.resolve()} if args.tree is not None else {})
    cpu = {(tree, case): [] for tree in trees for case in CASES}
    wall = {key: [] for key in cpu}
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for tree, path in trees.items():
            for case, (case_args, status, expected) in CASES.items():
                cpu_s, wall_s, code, last = _run_child(case_args, path)
                if code != status or expected not in last:
                    sys.exit(f"bench_cli_startup: {tree} tree, {case} (tpu-train "
                             f"{' '.join(case_args)}): exit {code}, last line {last!r}; "
                             f"expected exit {status} and {expected!r}")
                cpu[tree, case].append(cpu_s)
                wall[tree, case].append(wall_s)
    report = {
        "benchmark": "bench_cli_startup", "repeats": args.repeats,
        "commands": {case: "tpu-train " + " ".join(spec[0]) for case, spec in CASES.items()},
        "cpu_s": {tree: {case: _summary(cpu[tree, case]) for case in CASES} for tree in trees},
        "wall_s": {tree: {case: _summary(wall[tree, case]) for case in CASES} for tree in trees},
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    if args.tree is not None:
        report["other_tree"] = str(trees["other"])
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
