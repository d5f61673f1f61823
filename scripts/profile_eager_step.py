#!/usr/bin/env python
"""Where an eager training step's time goes: ``scripts/bench_eager_models.py``'s step (the tiny
transformers Llama, AdamW) in strict or fused eager mode on the tpu device.

After a warm-up, ``--steps`` blocked steps are timed; then a few steps run under Python's
``cProfile`` (the host: dispatch, op cache, transfers) and a few under ``jax.profiler`` (the
device programs each step runs and their busy time). Prints ONE JSON line: ``step_ms``
(fastest, median), ``first_step_s`` (every op compiled on first use), ``device_programs_per_step``,
``device_ms_per_step``, the costliest programs, the host functions with the most own time, and
``jax_floor_ms_per_step``: as many calls of one cached ``jax.jit`` program (a small elementwise op,
each call taking the last one's output) as the step runs device programs, timed the same way: the
dispatch cost JAX and the PJRT client add before any of this project's work; ``jax_call_us``,
what one plain JAX call costs with a Python float, a float on the device, or 21 arrays in and
out (the host's cost per buffer on this platform), and how much faster two threads make as
many calls (near 2: the call's host work runs without the GIL), and ``dispatch_thread``: the
same calls beside pure-Python work, on one thread and on two (would a dispatch thread beside
the op path hide them). The autograd engine runs the
backward on a thread of its own, which cProfile does not follow: its time shows as
``run_backward``'s own time.
``--out DIR`` also writes the line and the full cProfile listing there. On a CPU host the
device rows are empty (the CPU client writes no device lines). Usage::

    python scripts/profile_eager_step.py [--mode strict|fused] [--steps 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import glob
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROFILED = 3


def _device_programs(step) -> tuple[collections.Counter, collections.Counter]:
    import jax
    from jax._src.lib import _profile_data  # ProfileData: jax.profiler's own trace reader

    busy, calls = collections.Counter(), collections.Counter()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(PROFILED):
                step()
        trace = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
        for plane in _profile_data.ProfileData.from_file(trace).planes:
            if not plane.name.startswith("/device:") or plane.name.startswith("/device:CPU"):
                continue
            for line in plane.lines:
                if line.name == "XLA Modules":
                    for event in line.events:
                        name = event.name.split("(")[0]
                        busy[name] += event.duration_ns / PROFILED / 1e6
                        calls[name] += 1 / PROFILED
    return busy, calls


def _host_profile(step) -> tuple[list, str]:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(PROFILED):
        step()
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).sort_stats("tottime")
    stats.print_stats(60)
    top = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:15]  # (file, line, name): (.., tottime, ..)
    own = [(f"{os.path.basename(key[0])}:{key[1]} {key[2]}", round(v[2] / PROFILED * 1e3, 3),
            round(v[1] / PROFILED, 1)) for key, v in top]
    return own, text.getvalue()


def _jax_dispatch_floor(calls: int, repeats: int = 5) -> float:
    """Seconds for ``calls`` dispatches of one cached jitted elementwise program on device 0,
    chained and blocked at the end (fastest of ``repeats``)."""
    import jax
    import jax.numpy as jnp

    from tpu_train.device import runtime

    add_one = jax.jit(lambda x: x + 1)
    x = jax.device_put(jnp.zeros((64, 64), jnp.float32), runtime.jax_device(0))
    add_one(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        y = x
        for _ in range(calls):
            y = add_one(y)
        y.block_until_ready()
        best = min(best, time.perf_counter() - started)
    return best


def _jax_call_costs(repeats: int = 5, calls: int = 200) -> dict:
    """Microseconds per call of plain JAX programs that differ in what they take: one array
    (the floor above), an array and a Python float (JAX makes a device buffer of the float per
    call), an array and a float already on the device, and 21 arrays in and out (an optimizer's
    multi-tensor op): what a program's buffers cost the host on this platform."""
    import jax
    import jax.numpy as jnp

    from tpu_train.device import runtime

    device = runtime.jax_device(0)
    x = jax.device_put(jnp.zeros((4096,), jnp.float32), device)
    scale = jax.jit(lambda a, s: a * s)
    many = jax.jit(lambda *a: [v * 0.5 for v in a])
    arrays = [x + i for i in range(21)]
    on_device = jax.device_put(0.5, device)
    cases = {"one_array": (jax.jit(lambda a: a + 1), lambda y: (y,), 1),
             "array_and_python_float": (scale, lambda y: (y, 0.5), 1),
             "array_and_device_float": (scale, lambda y: (y, on_device), 1),
             "21_arrays_in_and_out": (many, lambda ys: ys, 21)}
    costs = {}
    for name, (program, arguments, width) in cases.items():
        start = x if width == 1 else arrays
        jax.block_until_ready(program(*arguments(start)))
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            y = start
            for _ in range(calls):
                y = program(*arguments(y))
            jax.block_until_ready(y)
            best = min(best, time.perf_counter() - started)
        costs[name] = round(best / calls * 1e6, 1)
    costs["two_threads_speedup"] = _two_threads_speedup(jax.jit(lambda a: a + 1), x, calls)
    costs["dispatch_thread"] = _dispatch_thread_overlap(jax.jit(lambda a: a + 1), x, calls)
    return costs


def _python_work(microseconds: float) -> None:
    """Busy pure-Python work for about ``microseconds`` (holds the GIL, like an op's dispatch)."""
    deadline = time.perf_counter() + microseconds * 1e-6
    while time.perf_counter() < deadline:
        pass


def _dispatch_thread_overlap(program, x, calls: int, python_us: float = 70.0,
                             repeats: int = 5) -> dict:
    """Would a dispatch thread hide the program calls' host time behind the op path's Python?

    ``calls`` chained calls of ``program``, each beside ``python_us`` of pure-Python work (about
    what a strict step's Python costs per program: a fused step's host time over a strict
    step's programs): one after the other on one thread, then the calls on a second thread
    while the first does the Python work, at Python's default GIL switch interval and at
    100 us. ``threaded / sequential`` near ``max(python, calls) / (python + calls)`` means the
    call's host work runs without the GIL; near 1 or above, a dispatch thread gains nothing."""
    import sys
    import threading

    import jax

    def sequential():
        y = x
        for _ in range(calls):
            y = program(y)
            _python_work(python_us)
        jax.block_until_ready(y)

    def threaded():
        def chain():
            y = x
            for _ in range(calls):
                y = program(y)
            jax.block_until_ready(y)

        worker = threading.Thread(target=chain)
        worker.start()
        for _ in range(calls):
            _python_work(python_us)
        worker.join()

    def best(run) -> float:
        fastest = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            fastest = min(fastest, time.perf_counter() - started)
        return fastest

    out = {"python_us_per_call": python_us, "calls": calls,
           "python_alone_ms": round(best(lambda: [_python_work(python_us)
                                                  for _ in range(calls)]) * 1e3, 2),
           "sequential_ms": round(best(sequential) * 1e3, 2),
           "threaded_ms": round(best(threaded) * 1e3, 2)}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        out["threaded_ms_switch_100us"] = round(best(threaded) * 1e3, 2)
    finally:
        sys.setswitchinterval(interval)
    return out


def _two_threads_speedup(program, x, calls: int, repeats: int = 5) -> float:
    """How much faster ``2 * calls`` chained calls finish on two threads (``calls`` each) than
    on one: near 2 when the call's host work runs without the GIL (a dispatch thread beside
    the op path would then hide it), near 1 when it holds the GIL throughout."""
    import threading

    import jax

    def chain(count):
        y = x
        for _ in range(count):
            y = program(y)
        jax.block_until_ready(y)

    def timed(threads: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            workers = [threading.Thread(target=chain, args=(2 * calls // threads,))
                       for _ in range(threads)]
            started = time.perf_counter()
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            best = min(best, time.perf_counter() - started)
        return best

    return round(timed(1) / timed(2), 2)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("strict", "fused"), default="strict")
    parser.add_argument("--steps", type=int, default=8, help="timed steps after the warm-up")
    parser.add_argument("--out", help="also write the report and the cProfile listing here")
    args = parser.parse_args(argv)
    import torch
    import transformers

    import bench_eager_models as bench
    from tpu_train.device import runtime

    torch.manual_seed(0)
    cpu_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**bench.CONFIG))
    ids = torch.randint(0, bench.CONFIG["vocab_size"], (bench.BATCH, bench.SEQ),
                        generator=torch.Generator().manual_seed(1))
    step = bench.Step(copy.deepcopy(cpu_model), torch.device("tpu", 0), ids, mode=args.mode)
    started = time.perf_counter()
    step()
    first = time.perf_counter() - started
    for _ in range(2):
        step()
    times = [step() for _ in range(args.steps)]
    own, listing = _host_profile(step)
    busy, calls = _device_programs(step)
    programs = round(sum(calls.values()))
    floor_ms = _jax_dispatch_floor(programs) * 1e3 if programs else None
    report = {
        "mode": args.mode, "platform": runtime.platform(), "device_kind": runtime.device_kind(0),
        "host_cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
        "first_step_s": round(first, 2),
        "step_ms": {"fastest": round(min(times) * 1e3, 2),
                    "median": round(statistics.median(times) * 1e3, 2)},
        "device_programs_per_step": round(sum(calls.values()), 1),
        "device_ms_per_step": round(sum(busy.values()), 3),
        "jax_floor_ms_per_step": None if floor_ms is None else round(floor_ms, 2),
        "jax_call_us": _jax_call_costs(),
        "top_programs": [(name, round(ms, 3), round(calls[name], 1))
                         for name, ms in busy.most_common(15)],
        "host_own_ms_per_step": own,  # (function, own ms per step, calls per step)
    }
    line = json.dumps(report)
    print(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"profile_eager_{args.mode}.json"), "w") as f:
            f.write(line + "\n")
        with open(os.path.join(args.out, f"profile_eager_{args.mode}.txt"), "w") as f:
            f.write(listing)
    return report


if __name__ == "__main__":
    main()
