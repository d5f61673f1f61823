#!/usr/bin/env python
"""Where a training step's time goes: the trainer's compiled step against the hand-written JAX
reference of the same model (``scripts/jax_llama.py``), on the device, from ``jax.profiler``.

The modes are built as ``scripts/bench_train_step.py --size`` builds them: the trainer's step
with its batches placed as its loop places them, ``jax`` and ``jax_ahead``. Each first runs
interleaved steps, each until its loss is read on the host (the benchmark's step time);
then a few steps of each are traced with ``jax.profiler`` and the trace is read back
(``ProfileData``). For each mode the report gives:

* ``step_ms``: fastest and median step (host + device, as the benchmark measures);
* ``device_programs``: every XLA program the device ran, with milliseconds and calls per step
  (the train step should be the only one: any other is a host dispatch per step);
* ``device_ms_per_step``: the device's busy time per step, and ``host_ms_per_step`` what the
  timed step spends beyond it (dispatch, transfers, Python);
* ``top_ops``: the costliest XLA ops (microseconds per step, the op's HLO head cut short);
* ``device_idle_us``: the device's idle windows between two programs (one a step where the
  step is the only program), and ``host_in_idle_us``: the host events (thread: name) inside
  those windows, microseconds per window: what the device waits for between steps.

On a CPU host the device rows are empty (the CPU client writes no device lines): there, only
``step_ms`` means anything. Prints ONE JSON line; ``--out DIR`` also writes it, with 40 top ops,
to ``DIR/profile_<size>.json``. Usage::

    python scripts/profile_train_step.py --size w1|350m|1b [--steps N] [--out DIR] [--python]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOP_OPS = 40


def idle_windows(program_spans: list) -> list:
    """The device's idle windows between consecutive programs, ``(start_ns, end_ns)``."""
    spans = sorted(program_spans)
    return [(end, start) for (_, end), (start, _) in zip(spans, spans[1:]) if start > end]


def host_in_windows(data, windows: list) -> dict:
    """How long each host event (``thread: name``) overlaps the device's idle windows,
    microseconds per window, the 25 largest. Events nest (a call and its parts), so the
    figures of one thread do not add up: read them as where the idle time is spent."""
    overlap = collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            thread = line.name.split("/")[0]
            for event in line.events:
                start, end = event.start_ns, event.start_ns + event.duration_ns
                for w_start, w_end in windows:
                    shared = min(end, w_end) - max(start, w_start)
                    if shared > 0:
                        overlap[f"{thread}: {event.name[:120]}"] += shared
    count = max(len(windows), 1)
    return {name: round(ns / count / 1e3, 1) for name, ns in overlap.most_common(25)}


def device_profile(mode, batches: list, python: bool = False) -> dict:
    """Per-step device programs, busy time and top ops of ``mode`` over ``batches``, the
    device's idle time between programs and the host events inside it; ``python``: Python's
    function calls among them too (which slows the host: for where, not how long)."""
    import jax
    from jax._src.lib import _profile_data  # ProfileData: jax.profiler's own trace reader

    steps = len(batches)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python else 0
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, profiler_options=options):
            for i, batch in enumerate(batches):
                loss = mode.step(batch)
                if i + 1 < steps:
                    mode.put_ahead(batches[i + 1])  # as the trainer's loop does
                mode.block(loss)
        trace = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
        data = _profile_data.ProfileData.from_file(trace)
        programs, calls = collections.Counter(), collections.Counter()
        ops, op_calls = collections.Counter(), collections.Counter()
        spans = []
        for plane in data.planes:
            if not plane.name.startswith("/device:") or plane.name.startswith("/device:CPU"):
                continue
            for line in plane.lines:
                table, counts = {"XLA Modules": (programs, calls),
                                 "XLA Ops": (ops, op_calls)}.get(line.name, (None, None))
                if table is None:
                    continue
                for event in line.events:
                    table[event.name] += event.duration_ns
                    counts[event.name] += 1
                    if line.name == "XLA Modules":
                        spans.append((event.start_ns, event.start_ns + event.duration_ns))
    windows = idle_windows(spans)
    idle = [(end - start) / 1e3 for start, end in windows]
    return {
        "device_idle_us": ({"windows": len(idle), "min": round(min(idle), 1),
                            "median": round(statistics.median(idle), 1)} if idle else None),
        "host_in_idle_us": host_in_windows(data, windows),
        "device_programs": {name: {"ms_per_step": round(ns / steps / 1e6, 3),
                                   "calls_per_step": calls[name] / steps}
                            for name, ns in programs.most_common()},
        "device_ms_per_step": round(sum(programs.values()) / steps / 1e6, 3),
        "top_ops": [{"op": name.split(" = ")[0] + " = " + name.split(" = ", 1)[-1][:160],
                     "us_per_step": round(ns / steps / 1e3, 1),
                     "calls_per_step": op_calls[name] / steps}
                    for name, ns in ops.most_common(TOP_OPS)],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("w1", "350m", "1b"), default="w1")
    parser.add_argument("--steps", type=int, default=20, help="blocked steps per mode")
    parser.add_argument("--profiled", type=int, default=5, help="traced steps per mode")
    parser.add_argument("--out", metavar="DIR", help="also write the report here")
    parser.add_argument("--python", action="store_true",
                        help="trace Python's function calls too (host_in_idle_us names them)")
    args = parser.parse_args(argv)

    import jax_llama
    import train_step_modes as tsm
    from bench_train_step import make_batches, run_interleaved

    import tpu_train  # noqa: F401
    from tpu_train.models import Llama

    size = jax_llama.SIZES[args.size]
    cfg = tsm.trainer_config("bf16", model=tsm.model_option(args.size))
    cpu_model = Llama(size.config())
    cpu_model.init_weights(seed=0, device="cpu")
    hyper = tsm.hyper_from(cfg)
    modes = {"compiled": tsm.TrainerMode(cpu_model, cfg, batches_ahead=True),
             "jax": tsm.ReferenceMode(cpu_model, size, hyper, "bf16"),
             "jax_ahead": tsm.ReferenceMode(cpu_model, size, hyper, "bf16", batches_ahead=True)}
    batches = make_batches(args.steps + 1, size.vocab_size, batch=size.batch, seq=size.seq)
    results = {name: {"times": [], "losses": []} for name in modes}
    run_interleaved(modes, results, batches)
    report = {"size": args.size, "date": time.strftime("%Y-%m-%d"), **tsm.device_facts(),
              "modes": {}}
    for name, mode in modes.items():
        timed = results[name]["times"][1:]  # the first step compiles
        median = statistics.median(timed)
        profile = device_profile(mode, batches[:args.profiled], python=args.python)
        report["modes"][name] = {
            "step_ms": {"fastest": round(min(timed) * 1e3, 3), "median": round(median * 1e3, 3)},
            "host_ms_per_step": (round(median * 1e3 - profile["device_ms_per_step"], 3)
                                 if profile["device_programs"] else None),
            **profile}
    top = {name: mode.pop("top_ops") for name, mode in report["modes"].items()}
    print(json.dumps(report))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for name, ops in top.items():
            report["modes"][name]["top_ops"] = ops
        with open(os.path.join(args.out, f"profile_{args.size}.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
