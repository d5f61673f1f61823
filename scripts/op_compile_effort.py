#!/usr/bin/env python
"""What XLA's optimization effort costs eager mode's one-op programs to compile for a TPU.

Runs the first step of the W1 trainer step in eager mode (``scripts/count_eager_compiles.py``'s
step) on the CPU client, keeps every one-op program it creates (those jitted with
``runtime.op_program_options()``: op executables, in-place ops, fills, storage reads and
writes) with the shapes of its first call, then compiles each one for a TPU without a chip
(JAX's compile-only topology, ``--target``, libtpu installed) at XLA's default effort (0) and
at the least (-1), the two alternating per program (which goes first alternates too). One
JSON line: the programs, the seconds at each effort (sum, median per program), their ratio,
the slowest programs at effort 0, and the cost analysis' bytes accessed at each effort (what
the least effort gives up, as far as XLA's own estimate says). Usage::

    python scripts/op_compile_effort.py [--target v5e:1x1] [--max-programs N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TPU_TRAIN_PLATFORM", "cpu")

EFFORTS = (0.0, -1.0)


class RecordingJit:
    """``jax.jit``'s result, remembering its function, options and first call's arguments."""

    def __init__(self, real_jit, fun, kwargs, recorded: list):
        import jax

        self.tracer = jax.core.Tracer
        self.jitted = real_jit(fun, **kwargs)
        self.fun, self.kwargs, self.recorded, self.arguments = fun, kwargs, recorded, None

    def __call__(self, *args):
        if any(isinstance(a, self.tracer) for a in args):  # traced (jax.eval_shape of it)
            return self.fun(*args)
        if self.arguments is None:
            self.arguments = args
            self.recorded.append(self)
        return self.jitted(*args)

    def __getattr__(self, name):
        return getattr(self.jitted, name)


def record_one_op_programs(op_options: dict) -> list:
    """Patch ``jax.jit`` so that one-op programs (jitted with ``op_options``) are recorded."""
    import jax

    real_jit, recorded = jax.jit, []

    def jit(fun=None, **kwargs):
        if fun is None or kwargs.get("compiler_options") != op_options:
            return real_jit(fun, **kwargs) if fun is not None else real_jit(**kwargs)
        return RecordingJit(real_jit, fun, kwargs, recorded)

    jax.jit = jit
    return recorded


def compile_seconds(program: RecordingJit, device, effort: float) -> tuple[float, float]:
    """(seconds, bytes accessed) of compiling ``program`` for ``device`` at ``effort``."""
    import jax
    import numpy as np

    sharding = jax.sharding.SingleDeviceSharding(device)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding,
                                  weak_type=getattr(a, "weak_type", False))
             if isinstance(a, (jax.Array, np.ndarray)) else a for a in program.arguments]
    kwargs = dict(program.kwargs, compiler_options={"exec_time_optimization_effort": effort})
    if "out_shardings" in kwargs:
        outs = kwargs["out_shardings"]
        kwargs["out_shardings"] = [sharding] * len(outs) if isinstance(outs, (list, tuple)) \
            else sharding
    lowered = jax.jit(program.fun, **kwargs).lower(*avals)
    started = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - started
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else (cost or {})
    return seconds, float(cost.get("bytes accessed", 0.0))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="v5e:1x1")
    parser.add_argument("--max-programs", type=int, default=0, help="0: all")
    args = parser.parse_args(argv)
    from tpu_train.device import runtime

    options = runtime.op_program_options()
    if options is None:
        parser.error(f"{runtime.EFFORT_ENV} is set: one-op programs then use it, unset it")
    recorded = record_one_op_programs(options)
    import jax

    import bench_train_step as bench
    import jax_llama
    import train_step_modes as tsm
    from tpu_train.compile.targets import TargetError, resolve_target
    from tpu_train.models import Llama

    size = jax_llama.SIZES["w1"]
    cfg = tsm.trainer_config("fp32", model=tsm.model_option("w1"), mode="eager")
    cpu_model = Llama(size.config())
    cpu_model.init_weights(seed=0, device="cpu")
    batch = bench.make_batches(1, size.vocab_size, batch=size.batch, seq=size.seq)[0]
    step = tsm.TrainerMode(cpu_model, cfg)
    try:  # before the step: a bad target is said at once
        device = resolve_target(args.target).devices[0]
    except TargetError as error:
        parser.error(str(error))
    step.block(step.step(batch))
    programs = recorded[:args.max_programs] if args.max_programs else recorded
    warm_up = jax.jit(lambda x: x + 1).lower(
        jax.ShapeDtypeStruct((8,), "float32", sharding=jax.sharding.SingleDeviceSharding(device)))
    warm_up.compile()  # the compiler's own start, not any program's
    seconds = {e: [] for e in EFFORTS}
    bytes_accessed = {e: 0.0 for e in EFFORTS}
    for number, program in enumerate(programs):
        order = EFFORTS if number % 2 == 0 else EFFORTS[::-1]
        for effort in order:
            s, b = compile_seconds(program, device, effort)
            seconds[effort].append(s)
            bytes_accessed[effort] += b
    slowest = sorted(range(len(programs)), key=lambda i: -seconds[0.0][i])[:5]
    report = {
        "target": args.target, "device_kind": device.device_kind, "programs": len(programs),
        "recorded": len(recorded), "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        **{f"effort_{e:g}_s": round(sum(seconds[e]), 2) for e in EFFORTS},
        **{f"effort_{e:g}_median_s": round(statistics.median(seconds[e]), 3) for e in EFFORTS},
        "least_over_default": round(sum(seconds[-1.0]) / sum(seconds[0.0]), 3),
        **{f"effort_{e:g}_bytes_accessed": bytes_accessed[e] for e in EFFORTS},
        "slowest_at_default": [
            {"function": getattr(programs[i].fun, "__qualname__", repr(programs[i].fun)),
             "shapes": [list(getattr(a, "shape", ())) for a in programs[i].arguments][:4],
             "default_s": round(seconds[0.0][i], 2), "least_s": round(seconds[-1.0][i], 2)}
            for i in slowest],
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
