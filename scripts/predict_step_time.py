#!/usr/bin/env python
"""Predict the step times of docs/benchmarks.md's TPU table from the compiled programs alone.

For each size (``w1``: 4 x 256 tokens, ``350m``: 8 x 1024, ``1b``: 4 x 2048, the shapes of
``scripts/jax_llama.py``), the step ``tpu-train model=llama_<size>`` runs
(``scripts/train_step_modes.py``'s config: bf16 compute with float32 weights and AdamW state,
the trainer's parameter groups, clipping to 1.0, skip-non-finite, the splash attention
kernels from 1,024 tokens) is compiled compile-only for ``--target`` (default one v5e) by
XLA's TPU compiler on this host (libtpu, no chip), and its optimized program is costed kernel
by kernel (``tpu_train.planning.step_time``). Compiles take 1-2 minutes (W1) to 6-10 (350M,
1B) on a 2-core host. Usage::

    python scripts/predict_step_time.py [--size w1 --size 350m ...] [--target v5e]
                                        [--program ours|jax] [--hlo-dir DIR] [--from-hlo DIR]

``--program jax`` predicts the table's other column instead: the hand-written JAX step
(``scripts/jax_llama.py`` at bf16, its batch put at its call), measured beside ours.

Prints ONE JSON line per size: the predicted step seconds and where they go (compute-,
memory- and vector-bound kernels, exposed copies and collectives), FLOPs and bytes per chip,
the MFU at the predicted time (the TPU table's definition, ``bench_train_step.step_flops``),
the costliest kernels and the model's basis; with the step measured on the chip where the
table has it (``MEASURED``) and the relative error. ``--hlo-dir`` writes each optimized
program there (``<size>.hlo``, ``<size>.jax.hlo``); ``--from-hlo`` costs the programs written
there before instead of compiling again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # this checkout's tpu_train

# Compile-only: libtpu must not look for chips or a metadata server on this host; the step
# is traced on the CPU client, and nothing runs, so no persistent cache.
for _name, _value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                      ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_TRAIN_PLATFORM", "cpu"),
                      ("TPU_TRAIN_CACHE_DIR", "off")):
    os.environ.setdefault(_name, _value)

SIZES = ("w1", "350m", "1b")
# docs/benchmarks.md, "The TPU table: one v5e chip": the trainer's compiled step, fastest /
# median seconds, with its date and commit. W1's is mostly the host's (its device program
# ran 1.875 ms of a 7.97 ms step on 2026-12-04, "Where the step time goes on the chip").
MEASURED = {
    "w1": {"fastest_s": 3.1e-3, "median_s": 3.4e-3, "when": "2026-12-07, 79e2ca9"},
    "350m": {"fastest_s": 125.2e-3, "median_s": 125.5e-3, "when": "2026-12-07, 79e2ca9"},
    "1b": {"fastest_s": 446.0e-3, "median_s": 446.6e-3, "when": "2026-12-07, 4843f15"},
}
# The JAX column of the same table (the 1B reference was not run).
MEASURED_JAX = {
    "w1": {"fastest_s": 3.2e-3, "median_s": 3.6e-3, "when": "2026-12-07, 79e2ca9"},
    "350m": {"fastest_s": 151.7e-3, "median_s": 152.1e-3, "when": "2026-12-07, 79e2ca9"},
}


def reference_text(size_name: str, target: str) -> tuple[str, float]:
    """``(optimized HLO text, compile seconds)`` of the JAX reference's bf16 step."""
    import jax

    import jax_llama
    from tpu_train.compile.targets import resolve_target

    size, hyper = jax_llama.SIZES[size_name], jax_llama.Hyper()
    cfg = size.config()
    sharding = jax.sharding.SingleDeviceSharding(resolve_target(target).devices[0])
    args = jax_llama.abstract_arguments(cfg, size, hyper, sharding)
    step = jax_llama.make_train_step(cfg, jax_llama.optimizer(args[0], hyper), precision="bf16")
    started = time.perf_counter()
    compiled = step.lower(*args).compile()
    return compiled.as_text(), time.perf_counter() - started


def compiled_text(size_name: str, target: str) -> tuple[str, float]:
    """``(optimized HLO text, compile seconds)`` of the trainer's step for ``size_name``."""
    import torch

    import jax_llama
    import train_step_modes
    from tpu_train.compile import lower_train_step
    from tpu_train.models import Llama
    from tpu_train.trainer.config import Precision
    from tpu_train.trainer.optim import parameter_groups
    from tpu_train.trainer.step import causal_lm_loss_sum_and_count

    size = jax_llama.SIZES[size_name]
    cfg = train_step_modes.trainer_config("bf16", model=train_step_modes.model_option(size_name))
    optim, trainer = cfg.optim, cfg.trainer
    with torch.device("meta"):
        model = Llama(size.config())
        tokens = torch.empty(size.batch, size.seq, dtype=torch.long)
    optimizer = torch.optim.AdamW(parameter_groups(model, optim.weight_decay), lr=optim.lr,
                                  betas=(optim.beta1, optim.beta2), eps=optim.eps)
    started = time.perf_counter()
    program = lower_train_step(model, optimizer, causal_lm_loss_sum_and_count,
                               {"tokens": tokens, "labels": tokens.clone()},
                               max_grad_norm=trainer.max_grad_norm, skip_non_finite=True,
                               compute_dtype=Precision(trainer.precision).compute_dtype,
                               scan_layers=trainer.scan_layers, target=target,
                               runtime_options=False)
    return program.executable.as_text(), time.perf_counter() - started


def predict(size_name: str, text: str, target: str, program: str = "ours") -> dict:
    import jax_llama
    import train_step_modes
    from tpu_train.planning.step_time import predict_step_time

    size = jax_llama.SIZES[size_name]
    model_flops = train_step_modes.step_flops(size)
    report = predict_step_time(text, target, model_flops_per_chip=model_flops)
    out = {"size": size_name, "program": program, "batch": size.batch, "seq": size.seq,
           "target": target, "model_flops": model_flops, **report}
    measured = (MEASURED if program == "ours" else MEASURED_JAX).get(size_name)
    if measured and target.partition(":")[0] == "v5e":
        out["measured"] = measured
        out["error_vs_fastest"] = report["step_time_s"] / measured["fastest_s"] - 1
    return out


def _hlo_name(size_name: str, program: str) -> str:
    return f"{size_name}.hlo" if program == "ours" else f"{size_name}.{program}.hlo"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", action="append", choices=SIZES,
                        help=f"a size to predict (repeatable; default: {' '.join(SIZES)})")
    parser.add_argument("--target", default="v5e", help="a one-chip TPU name: v5e, v5p, v6e")
    parser.add_argument("--program", choices=("ours", "jax"), default="ours",
                        help="the trainer's step, or the hand-written JAX reference")
    parser.add_argument("--hlo-dir", help="write each optimized program here (<size>.hlo)")
    parser.add_argument("--from-hlo", help="cost the programs --hlo-dir wrote here instead")
    args = parser.parse_args(argv)
    from tpu_train.compile.targets import TargetError, libtpu_available, resolve_target

    if args.from_hlo is None:
        if not libtpu_available():
            parser.error('libtpu is not installed: pip install -c constraints.txt -e ".[tpu]"')
        try:
            if resolve_target(args.target).num_chips != 1:
                parser.error(f"--target {args.target}: name one chip (e.g. v5e)")
        except TargetError as error:
            parser.error(str(error))
    reports = []
    for name in dict.fromkeys(args.size or SIZES):
        if args.from_hlo:
            path = os.path.join(args.from_hlo, _hlo_name(name, args.program))
            if not os.path.isfile(path):
                parser.error(f"--from-hlo {args.from_hlo}: no {_hlo_name(name, args.program)} "
                             f"there (write it with --hlo-dir)")
            with open(path) as f:
                text, seconds = f.read(), None
        else:
            build = compiled_text if args.program == "ours" else reference_text
            text, seconds = build(name, args.target)
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            with open(os.path.join(args.hlo_dir, _hlo_name(name, args.program)), "w") as f:
                f.write(text)
        report = predict(name, text, args.target, args.program)
        report["compile_s"] = None if seconds is None else round(seconds, 1)
        print(json.dumps(report), flush=True)
        reports.append(report)
    return reports


if __name__ == "__main__":
    main()
