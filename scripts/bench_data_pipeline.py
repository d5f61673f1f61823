"""Does building batches off the training loop's critical path shorten its steps, and how?

Exact command (from the repository root)::

    python scripts/bench_data_pipeline.py    # --steps 150 --rounds 5 --wait-ms 3.3 --dispatch-ms 1

A simulated training loop is fed by the default job's loader (``PackedLoader`` over the bundled
``tasks_train.jsonl``, the bundled tokenizer, 16 rows of 128 tokens). Each step is the shape
of a compiled step on a TPU: ``--dispatch-ms`` of Python that holds the GIL (a fixed amount of
work, calibrated alone, so that a GIL lost to another thread lengthens it), then a device wait
of ``--wait-ms`` that releases the GIL (a sleep, as ``float(loss)`` blocks). Modes:

* ``floor``: the same batch every step, no loading: the loop's own period;
* ``sync``: each batch built between steps (``data.prefetch=0``);
* ``thread-1``, ``thread-2``: :class:`~tpu_train.data.prefetch.Prefetcher`, batches built
  1 or 2 ahead on a thread, which shares the GIL with the loop;
* ``process-1``, ``process-2``: the trainer's :class:`~tpu_train.data.worker.WorkerPrefetcher`
  (``data.prefetch=1``, ``2``): batches built in a worker process and sent, with the loader's
  state, through a pipe: no GIL in common with the loop.

The modes run interleaved ``--rounds`` times in one process (a shared machine's timings swing)
and one JSON line reports, per mode, the step period (min and median over rounds, ms), the
median dispatch time and the 90th percentile of how late the loop woke from its device wait
(both show GIL contention), and the CPU time of this process per step. ``encode`` reports the
tokenizer's cost per read-ahead chunk (512 texts) with the library's batch call (its own
thread pool, GIL released), with that pool off (``TOKENIZERS_PARALLELISM=false``, set only in
a child process that measures it) and one text per call (one thread, GIL held).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tpu_train.data import PackedLoader, default_corpus_dir, load_tokenizer  # noqa: E402
from tpu_train.data.prefetch import Prefetcher  # noqa: E402
from tpu_train.data.worker import WorkerPrefetcher  # noqa: E402

TASKS = default_corpus_dir() / "tasks_train.jsonl"
SEQ_LEN, BATCH = 128, 16  # the default job's batch


def default_loader() -> PackedLoader:
    return PackedLoader(TASKS, load_tokenizer(), SEQ_LEN, BATCH)


def python_work(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i & 7
    return total


def calibrate(dispatch_s: float) -> int:
    """Iterations of :func:`python_work` that take ``dispatch_s`` alone (best of 20)."""
    iterations = 10_000
    best = min(_timed(python_work, iterations) for _ in range(20))
    return max(1, int(iterations * dispatch_s / best))


def _timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def open_batches(mode: str):
    if mode == "floor":
        return itertools.repeat(next(default_loader())), None
    if mode == "sync":
        return default_loader(), None
    kind, depth = mode.split("-")
    prefetcher = Prefetcher if kind == "thread" else WorkerPrefetcher
    batches = prefetcher(default_loader(), int(depth))
    batches.start()
    return batches, batches.close


def run_mode(mode: str, steps: int, warmup: int, iterations: int, wait_s: float) -> dict:
    batches, close = open_batches(mode)
    dispatch, late = [], []
    try:
        for _ in range(warmup):  # the worker's start-up and first batches are not measured
            next(batches)
        cpu, started = time.process_time(), time.perf_counter()
        for _ in range(steps):
            next(batches)
            dispatch.append(_timed(python_work, iterations))
            asleep = time.perf_counter()
            time.sleep(wait_s)
            late.append(time.perf_counter() - asleep - wait_s)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        if close is not None:
            close()
    late.sort()
    return {"period": elapsed / steps, "dispatch": statistics.median(dispatch),
            "late_p90": late[int(0.9 * len(late))], "cpu": cpu / steps}


def encode_costs() -> dict:
    """ms per 512-text chunk (wall, CPU) of the bundled task's texts, best of 3 passes."""
    raw = load_tokenizer()._tok
    records = [json.loads(line) for line in itertools.islice(TASKS.open(), 2560)]
    texts = [text for record in records for text in (record["prompt"], record["response"])]
    chunks = [texts[i:i + 512] for i in range(0, len(texts), 512)]
    calls = {"batch_call": lambda c: raw.encode_batch_fast(c, add_special_tokens=False),
             "one_text_per_call": lambda c: [raw.encode(t, add_special_tokens=False) for t in c]}
    out = {}
    for name, call in calls.items():
        passes = []
        for _ in range(3):
            cpu, started = time.process_time(), time.perf_counter()
            for chunk in chunks:
                call(chunk)
            passes.append(((time.perf_counter() - started) * 1e3 / len(chunks),
                           (time.process_time() - cpu) * 1e3 / len(chunks)))
        wall, cpu = min(passes)
        out[name] = {"wall_ms": round(wall, 3), "cpu_ms": round(cpu, 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--wait-ms", type=float, default=3.3)
    parser.add_argument("--dispatch-ms", type=float, default=1.0)
    parser.add_argument("--modes", default="floor,sync,thread-1,thread-2,process-1,process-2")
    parser.add_argument("--encode-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.encode_only:
        print(json.dumps(encode_costs()))
        return
    modes = args.modes.split(",")
    iterations = calibrate(args.dispatch_ms / 1e3)
    rounds: dict[str, list[dict]] = {mode: [] for mode in modes}
    for index in range(args.rounds):
        for mode in modes[index % len(modes):] + modes[:index % len(modes)]:
            rounds[mode].append(run_mode(mode, args.steps, args.warmup, iterations,
                                         args.wait_ms / 1e3))

    def ms(values):
        return round(1e3 * statistics.median(values), 3)

    report = {mode: {"period_ms": {"min": round(1e3 * min(r["period"] for r in runs), 3),
                                   "median": ms([r["period"] for r in runs])},
                     "dispatch_ms": ms([r["dispatch"] for r in runs]),
                     "late_wake_p90_ms": ms([r["late_p90"] for r in runs]),
                     "cpu_ms_per_step": ms([r["cpu"] for r in runs])}
              for mode, runs in rounds.items()}
    encode = encode_costs()
    child = subprocess.run([sys.executable, __file__, "--encode-only"], capture_output=True,
                           text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
                           check=True)
    encode["batch_call_pool_off"] = json.loads(child.stdout)["batch_call"]
    print(json.dumps({"bench": "data_pipeline", "cpus": os.cpu_count(),
                      "step": {"dispatch_ms": args.dispatch_ms, "wait_ms": args.wait_ms},
                      "steps": args.steps, "rounds": args.rounds, "modes": report,
                      "encode_per_512_texts": encode}))


if __name__ == "__main__":
    main()
