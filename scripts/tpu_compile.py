#!/usr/bin/env python
"""Compile the trainer's train step for a TPU with XLA's TPU compiler, on any host: no chip.

Needs libtpu (``pip install -c constraints.txt -e ".[tpu]"``); the step is lowered on this
host's CPU client and compiled for ``--target`` (``tpu_train.compile.targets``), never run.
The step is the one ``tpu-train`` builds: AdamW, clipping to 1.0, skip-non-finite, and for
``--precision bf16`` bfloat16 compute with float32 master weights.

``--size default`` is the bundled default job's model and batch (``model=debug_tiny``, 16 x
128); ``w1``, ``350m``, ``1b`` are the sizes of ``scripts/jax_llama.py``. Prints ONE JSON
line: trace / lower / XLA compile seconds, the TPU compiler's bytes accessed, FLOPs and peak
memory per chip, and the optimized program's fusion and dot counts. Usage::

    python scripts/tpu_compile.py [--size default|w1|350m|1b] [--precision fp32|bf16]
                                  [--matmul-precision highest|high|medium] [--target v5e]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Compile-only: libtpu must not look for chips or a metadata server on this host, and other
# processes (a test run) may have loaded it too. The step itself is traced on the CPU client.
for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                    ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_TRAIN_PLATFORM", "cpu")):
    os.environ.setdefault(name, value)


def build(size: str):
    """``(model on meta, batch of meta tensors)`` for ``size``."""
    import torch

    from tpu_train.models import CONFIGS, Llama

    if size == "default":
        config, batch, seq = CONFIGS["debug_tiny"], 16, 128
    else:
        import jax_llama

        shape = jax_llama.SIZES[size]
        config, batch, seq = shape.config(), shape.batch, shape.seq
    with torch.device("meta"):
        model = Llama(config)
    tokens = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, {"tokens": tokens, "labels": tokens.clone()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("default", "w1", "350m", "1b"), default="default")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--matmul-precision", choices=("highest", "high", "medium"),
                        default="medium", help="float32 dots (the default job's setting)")
    parser.add_argument("--target", default="v5e", help="a TPU name, e.g. v5e or v5p:2x2x1")
    args = parser.parse_args(argv)

    import torch

    import tpu_train  # noqa: F401
    from tpu_train.compile import lower_train_step
    from tpu_train.compile.targets import TargetError, libtpu_available
    from tpu_train.ops.matmul import set_matmul_precision
    from tpu_train.trainer.step import causal_lm_loss_sum_and_count

    if not libtpu_available():
        parser.error('libtpu is not installed: pip install -c constraints.txt -e ".[tpu]"')
    set_matmul_precision(args.matmul_precision)
    model, batch = build(args.size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    bf16 = torch.bfloat16 if args.precision == "bf16" else None
    started = time.perf_counter()
    try:
        program = lower_train_step(model, optimizer, causal_lm_loss_sum_and_count, batch,
                                   max_grad_norm=1.0, skip_non_finite=True, target=args.target,
                                   autocast_dtype=bf16, compute_dtype=bf16)
    except TargetError as error:
        parser.error(str(error))
    text = program.executable.as_text()
    report = {"size": args.size, "precision": args.precision,
              "matmul_precision": args.matmul_precision, "target": args.target,
              "date": time.strftime("%Y-%m-%d"), "host_cores": os.cpu_count(),
              "seconds": {k: round(v, 2) for k, v in program.seconds.items()},
              "wall_s": round(time.perf_counter() - started, 2), **program.analysis(),
              "fusions": text.count(" fusion("),
              "dots": text.count(" convolution(") + text.count(" dot(")}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
