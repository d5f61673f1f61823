"""Where the default job's process wall time goes, cold: one JSON line.

Exact command (from the repository root; the tree whose ``tpu_train`` is timed is the current
directory, or ``--tree``)::

    python scripts/default_job_wall.py [--tree CHECKOUT] [--rounds 1] [--cache off|fresh]
                                       [--entry console|module] [--compiles] [-- OVERRIDES...]

Each round runs ``tpu-train run.dir=<fresh temporary> OVERRIDES`` (``tpu_train.cli.main``) in
a fresh process with ``TPU_TRAIN_CACHE_DIR=off`` (every program compiled cold) and reads its console as
it comes: seconds from the process's start to its first log line (imports, opening the device,
tokenizer, data, model), to the step-0 validation line (the first validation, its compiles), to
the "compiled the train step" line (printed after the first step), to the closing summary, and
to the end of the process (its exit, split in ``exit``: Python's exit handlers, then the
native teardown); with the compile line, the exact match, the
summary's wall time and the process's host CPU time (user and system seconds, and their sum
over the wall time), split by thread name (``threads``: CPU seconds per name with its digits
dropped, read from /proc every half second, so a thread that lived less than that may be
missed). The targets for the default job on a v5e chip: ``end`` <= 60 s, the
train step's compile <= 15 s, exact match >= 90 %, host CPU time <= 2x the wall time.

``--cache fresh`` gives each run an empty persistent cache directory instead of none;
``--entry module`` starts ``python -m tpu_train.cli`` instead of the console script's code
(then ``exit`` is not split); ``--compiles`` adds ``compiles``: every XLA compile of the run
(count and seconds per thread, and those of 0.5 s or more: when they ended, their seconds, the
thread), from JAX's compile-duration event. Environment variables reach the run as they are
(``LIBTPU_INIT_ARGS`` to try libtpu's flags, ``JAX_EXEC_TIME_OPTIMIZATION_EFFORT``).
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKS = (("first_log_line", "run dir: "), ("data_line", "data: "),
         ("decoding_compiled", "validation decoding:"), ("validated_step_0", "| validation |"),
         ("train_step_compiled", "the train step in"), ("summary", "finished step"))


class ThreadCpu:
    """CPU seconds of each thread of process ``pid`` (Linux /proc), sampled on a thread of its
    own until :meth:`stop`; grouped by thread name with digits dropped."""

    def __init__(self, pid: int, every_s: float = 0.5):
        self.pid, self.every_s, self.seen = pid, every_s, {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._done.wait(self.every_s):
            try:
                tasks = os.listdir(f"/proc/{self.pid}/task")
            except OSError:
                return
            for tid in tasks:
                try:
                    stat = Path(f"/proc/{self.pid}/task/{tid}/stat").read_text()
                except OSError:
                    continue
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                self.seen[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)

    def stop(self) -> dict[str, float]:
        self._done.set()
        self._thread.join()
        groups: dict[str, float] = {}
        for name, seconds in self.seen.values():
            key = re.sub(r"\d+", "#", name)
            groups[key] = groups.get(key, 0.0) + seconds
        return {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1]) if v}


# ``tpu-train`` in the child, with the moments of its exit marked on stdout: when main returned,
# when the first exit handler ran (registered last) and the last (registered before JAX and
# torch were imported, so it runs after their clean-up); the native teardown comes after.
# ``sys.argv`` is the console script's before ``import tpu_train``: the import reads it to
# decide whether to open the device early (tpu_train/startup.py), as it does for a user.
CHILD = """
import atexit, json, os, sys, threading, time
mark = lambda name: print(f"@exit {name} {time.monotonic():.3f}", flush=True)
atexit.register(mark, "handlers_done")
if os.environ.get("DEFAULT_JOB_WALL_COMPILES"):
    # Every XLA compile: when it ended (the host's monotonic clock, which the harness shares),
    # its seconds, the thread it ran on, the function compiled (JAX's public duration event;
    # printed once main has returned).
    import jax
    compiles = []
    def on_duration(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append((time.monotonic(), round(seconds, 3),
                             threading.current_thread().name, fun_name))
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    atexit.register(lambda: print("@compiles " + json.dumps(compiles), flush=True))
sys.argv = ["tpu-train", *sys.argv[1:]]
from tpu_train import cli
try:
    cli.main()
finally:
    mark("main_returned")
    atexit.register(mark, "handlers_started")
"""
EXIT_MARKS = ("main_returned", "handlers_started", "handlers_done")


def exit_seconds(lines: list[str], ended: float) -> dict[str, float]:
    """Seconds of the exit's parts: ``handlers`` (Python's exit handlers: JAX's and torch's
    clean-up among them) and ``teardown`` (from the last handler to the process's end)."""
    at = {}
    for line in lines:
        if line.startswith("@exit "):
            _, name, stamp = line.split()
            at[name] = float(stamp)
    if not all(name in at for name in EXIT_MARKS):
        return {}
    return {"handlers": round(at["handlers_done"] - at["handlers_started"], 2),
            "teardown": round(ended - at["handlers_done"], 2)}


def one_run(tree: Path, overrides: list[str], cache: str = "off", entry: str = "console",
            compiles: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        # "fresh": a persistent cache directory of its own, empty: as cold as "off" for the
        # first compile of each program, with the cache's own work (keys, writes) included.
        cache_dir = "off" if cache == "off" else f"{directory}/xla_cache"
        env = dict(os.environ, TPU_TRAIN_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
        if compiles:
            env["DEFAULT_JOB_WALL_COMPILES"] = "1"
        if entry == "module":  # python -m tpu_train.cli: no exit marks
            command = [sys.executable, "-m", "tpu_train.cli", f"run.dir={directory}/run", *overrides]
        else:
            command = [sys.executable, "-c", CHILD, f"run.dir={directory}/run", *overrides]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started, started_monotonic = time.perf_counter(), time.monotonic()
        process = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        threads = ThreadCpu(process.pid)
        seconds: dict[str, float] = {}
        lines = []
        timeline = []
        for line in process.stdout:
            lines.append(line.rstrip())
            if compiles and not line.startswith("@"):
                timeline.append((round(time.perf_counter() - started, 2), line.strip()[:120]))
            for key, text in MARKS:
                if key not in seconds and text in line:
                    seconds[key] = round(time.perf_counter() - started, 2)
        code = process.wait()
        ended = time.monotonic()
        seconds["end"] = round(time.perf_counter() - started, 2)
        thread_cpu = threads.stop()
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
    listed = next((json.loads(line[len("@compiles "):]) for line in lines
                   if line.startswith("@compiles ")), None)
    if listed is not None:
        found["compiles"] = compile_summary(
            [(round(end - started_monotonic, 2), *rest) for end, *rest in listed])
        found["timeline"] = timeline
    return {"exit_status": code, "seconds": seconds, "exit": exit_seconds(lines, ended),
            "cpu": cpu, "threads": thread_cpu, **found}


def compile_summary(listed: list) -> dict:
    """``--compiles``: their count and seconds per thread, and each compile of 0.5 s or more
    (end, seconds, thread, function; seconds since the child started), in the order they ended."""
    per_thread: dict[str, list] = {}
    for _, seconds, thread, _ in listed:
        entry = per_thread.setdefault(re.sub(r"\d+", "#", thread), [0, 0.0])
        entry[0] += 1
        entry[1] = round(entry[1] + seconds, 2)
    return {"count": len(listed), "seconds": round(sum(c[1] for c in listed), 2),
            "per_thread": {k: {"count": n, "seconds": t} for k, (n, t) in per_thread.items()},
            "long": [c for c in listed if c[1] >= 0.5]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="the checkout whose tpu_train runs (default: this one)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cache", choices=("off", "fresh"), default="off",
                        help="TPU_TRAIN_CACHE_DIR=off (default) or an empty directory per run")
    parser.add_argument("--entry", choices=("console", "module"), default="console",
                        help="the console script's code (default) or python -m tpu_train.cli")
    parser.add_argument("--compiles", action="store_true",
                        help="list the child's XLA compiles (count, seconds per thread, long ones)")
    parser.add_argument("overrides", nargs="*", help="tpu-train overrides (after --)")
    args = parser.parse_args()
    runs = [one_run(args.tree.resolve(), args.overrides, args.cache, args.entry, args.compiles)
            for _ in range(args.rounds)]
    ends = [run["seconds"]["end"] for run in runs]
    compile_s = [float(m.group(1)) for run in runs if run["compile_line"]
                 for m in [re.search(r"the train step in ([0-9.]+) s", run["compile_line"])] if m]
    print(json.dumps({"tree": str(args.tree.resolve()), "overrides": args.overrides,
                      "end_s": ends, "train_step_compile_s": compile_s,
                      "load_average": os.getloadavg()[0], "runs": runs}))


if __name__ == "__main__":
    main()
