#!/usr/bin/env python
"""What the first steps of the W1 trainer step in eager mode compile, and what that costs.

Builds the step as ``scripts/bench_train_step.py --size w1 --only eager`` does (the trainer's
step at ``trainer.mode=eager``, or ``--mode fused``), runs ``--steps`` steps and counts, per
step, from JAX's monitoring events: the XLA compiles
(``/jax/core/compile/backend_compile_duration``) and their seconds, the seconds spent
tracing jaxprs and lowering them to MLIR, and the step's wall time, so that a slow first
step can be split into compiling, JAX's tracing and lowering, and everything else, and lists
each step's slowest compiles (module name, MLIR lines, seconds). It also says how many of the
compiled modules are textually distinct
(names and source locations removed): executables shared between identical programs could only
save the difference. One JSON line on stdout. Usage::

    python scripts/count_eager_compiles.py [--mode eager|fused] [--steps 3]
    TPU_TRAIN_PLATFORM=tpu python scripts/count_eager_compiles.py     # on a chip

Every op shape compiles on its first use: with a warm persistent cache
(``TPU_TRAIN_CACHE_DIR``) only programs whose compile took longer than
``compilation_cache.MIN_COMPILE_TIME_S`` are loaded instead; ``--cache-all DIR`` keeps every
program in DIR (run it twice: the second run's first step shows what loading them saves).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_EVENTS = {"/jax/core/compile/backend_compile_duration": "xla_compile",
           "/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower"}


class Counter:
    def __init__(self):
        self.seconds = collections.Counter()
        self.compiles = 0
        self.modules = collections.Counter()
        self.programs: list = []  # (module name, MLIR lines, seconds) per compile, in order

    def on_duration(self, event: str, duration: float, **_kwargs) -> None:
        name = _EVENTS.get(event)
        if name is not None:
            self.seconds[name] += duration
            self.compiles += name == "xla_compile"

    def snapshot(self) -> tuple:
        return self.compiles, dict(self.seconds)


def watch_modules(counter: Counter):
    """Hash every module handed to XLA (names and locations removed) into
    ``counter.modules``; returns a function that stops watching."""
    from jax._src import compiler
    from jax._src.interpreters import pxla

    original = compiler.compile_or_get_cached

    def spy(backend, computation, *args, **kwargs):
        full = str(computation)
        text = re.sub(r"loc\(.*?\)|module @\S+", "", full)
        counter.modules[hashlib.sha1(text.encode()).hexdigest()] += 1
        name = re.search(r"module @(\S+)", full)
        started = time.perf_counter()
        try:
            return original(backend, computation, *args, **kwargs)
        finally:
            counter.programs.append((name.group(1) if name else "?", text.count("\n"),
                                     time.perf_counter() - started))

    compiler.compile_or_get_cached = spy

    def stop():
        compiler.compile_or_get_cached = original

    return stop


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("eager", "fused"), default="eager")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--slowest", type=int, default=6,
                        help="list this many of each step's slowest compiles")
    parser.add_argument("--cache-all", metavar="DIR",
                        help="keep every compiled program in this persistent cache directory")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.cache_all:
        os.environ["TPU_TRAIN_CACHE_DIR"] = args.cache_all
    import jax

    import bench_train_step as bench
    import jax_llama
    import train_step_modes as tsm
    from tpu_train.device import runtime
    from tpu_train.models import Llama

    counter = Counter()
    jax.monitoring.register_event_duration_secs_listener(counter.on_duration)
    watch_modules(counter)
    size = jax_llama.SIZES["w1"]
    cfg = tsm.trainer_config("fp32", model=tsm.model_option("w1"), mode=args.mode)
    cpu_model = Llama(size.config())
    cpu_model.init_weights(seed=0, device="cpu")
    batches = bench.make_batches(args.steps, size.vocab_size, batch=size.batch, seq=size.seq)
    started = time.perf_counter()
    step = tsm.TrainerMode(cpu_model, cfg)
    if args.cache_all:  # after the runtime configured the cache: keep every program
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    report = {"mode": args.mode, "platform": runtime.platform(),
              "device_kind": runtime.device_kind(0), "date": time.strftime("%Y-%m-%d"),
              "cache_all": bool(args.cache_all),
              "setup": _delta((0, {}), counter.snapshot(), time.perf_counter() - started)}
    for number, batch in enumerate(batches, 1):
        before, started = counter.snapshot(), time.perf_counter()
        first_program = len(counter.programs)
        step.block(step.step(batch))
        report[f"step{number}"] = _delta(before, counter.snapshot(),
                                         time.perf_counter() - started)
        report[f"step{number}"]["slowest"] = _slowest(counter.programs[first_program:],
                                                      args.slowest)
    report["programs_compiled"] = counter.compiles
    report["distinct_modules"] = len(counter.modules)
    print(json.dumps(report))
    return report


def _slowest(programs: list, count: int) -> list:
    """The ``count`` slowest of ``programs``: [module name, MLIR lines, seconds]."""
    ranked = sorted(programs, key=lambda p: -p[2])[:count]
    return [[name, lines, round(seconds, 2)] for name, lines, seconds in ranked]


def _delta(before: tuple, after: tuple, wall: float) -> dict:
    (compiles0, seconds0), (compiles1, seconds1) = before, after
    out = {"wall_s": round(wall, 2), "compiles": compiles1 - compiles0}
    for name in _EVENTS.values():
        out[f"{name}_s"] = round(seconds1.get(name, 0.0) - seconds0.get(name, 0.0), 2)
    return out


if __name__ == "__main__":
    main()
