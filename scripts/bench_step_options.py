#!/usr/bin/env python
"""XLA options against the device: the trainer's step compiled with the runtime's options and
with extra ones, each compile timed, then both programs run interleaved on this host's device.

The step is ``scripts/tpu_compile.py``'s (the default job's by default: AdamW, clipping to 1.0,
skip-non-finite), lowered once on this process's device (a TPU chip where there is one) and
compiled twice: with ``tpu_train.device.runtime.compiler_options`` (what the trainer passes)
and with those plus ``--options`` (a JSON object of XLA compile options). Both programs then
run ``--steps`` times each, alternating, on zero-filled arguments (the step's timing does not
depend on its values; a skipped non-finite step costs the same select). Prints ONE JSON line:
per program its XLA compile seconds, median and fastest step milliseconds (each step waited
for), bytes accessed and FLOPs (XLA's cost analysis), and the ratios. Usage::

    python scripts/bench_step_options.py [--size default|w1] [--precision fp32|bf16]
        [--options '{"xla_jf_conv_input_fusion": false}'] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Compile times are measured: no program comes from the persistent compilation cache.
os.environ.setdefault("TPU_TRAIN_CACHE_DIR", "off")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("default", "w1"), default="default")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--options", default='{"xla_jf_conv_input_fusion": false}',
                        help="JSON object of XLA compile options to add")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    try:
        extra = json.loads(args.options)
    except json.JSONDecodeError as error:
        parser.error(f"--options is not JSON ({error.msg}): pass e.g. '{{\"xla_name\": true}}'")
    if not isinstance(extra, dict):
        parser.error("--options must be a JSON object of option names to values")
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    import jax
    import torch

    import tpu_compile
    import tpu_train  # noqa: F401
    from tpu_train.compile import lower_train_step
    from tpu_train.device import runtime
    from tpu_train.ops.matmul import set_matmul_precision
    from tpu_train.trainer.step import causal_lm_loss_sum_and_count

    set_matmul_precision("medium")
    model, batch = tpu_compile.build(args.size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    bf16 = torch.bfloat16 if args.precision == "bf16" else None
    program = lower_train_step(model, optimizer, causal_lm_loss_sum_and_count, batch,
                               max_grad_norm=1.0, skip_non_finite=True, autocast_dtype=bf16,
                               compute_dtype=bf16, compile=False)
    base = dict(program.compiler_options or {})
    variants = {"runtime": base, "with_options": {**base, **extra}}
    compiled, report = {}, {"size": args.size, "precision": args.precision, "options": extra,
                            "platform": runtime.platform(), "device": runtime.device_kind()}
    for name, options in variants.items():
        started = time.perf_counter()
        compiled[name] = program.lowered.compile(compiler_options=options)
        cost = compiled[name].cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        report[name] = {"compile_s": round(time.perf_counter() - started, 2),
                        "bytes_accessed": cost.get("bytes accessed"), "flops": cost.get("flops")}
    args_info, kwargs_info = program.lowered.args_info

    def zeros(info):
        return jax.numpy.zeros(info.shape, info.dtype)

    times = {name: [] for name in compiled}
    for step in range(args.steps + 1):  # the first call of each is not timed
        for name, executable in compiled.items():
            call_args = jax.tree_util.tree_map(zeros, args_info)
            call_kwargs = jax.tree_util.tree_map(zeros, kwargs_info)
            jax.block_until_ready((call_args, call_kwargs))
            started = time.perf_counter()
            jax.block_until_ready(executable(*call_args, **call_kwargs))
            if step:
                times[name].append(time.perf_counter() - started)
    for name, seconds in times.items():
        report[name]["median_step_ms"] = round(1e3 * statistics.median(seconds), 3)
        report[name]["fastest_step_ms"] = round(1e3 * min(seconds), 3)
    for key in ("compile_s", "median_step_ms"):
        report[f"{key}_ratio"] = round(report["with_options"][key] / report["runtime"][key], 3)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
