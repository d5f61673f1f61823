#!/usr/bin/env python
"""The trainer's compiled step against the hand-written JAX reference (``scripts/jax_llama.py``),
both compiled for a TPU v5e by XLA's TPU compiler on any host (libtpu, no chip): bytes accessed
and FLOPs per step from the compiler's cost analysis, and their ratios (compiled / reference).

What is compared, at bf16:

* ours: the step ``tpu-train trainer.mode=compiled trainer.precision=bf16`` builds, lowered
  from a model on ``meta`` (``tpu_train.compile.lower_train_step``): bf16 compute with float32
  master weights (``compute_dtype``), the trainer's loss, AdamW on the trainer's two parameter
  groups, clipping to 1.0, skip-non-finite;
* the reference: ``jax_llama.make_train_step`` at ``precision="bf16"`` (optax clip + AdamW,
  parameters and state donated), the way a JAX user writes the same model.

Both compile with the same options, :data:`OPTIONS`: memory-space assignment off. With it on
(the compiler's default), the cost analysis also counts the asynchronous copies and sliced
prefetches that move arrays between HBM and the chip's on-core memory, and those follow the
compiler's scheduling rather than the program: W1's step went from 3.82 to 3.40 GB when only
the embedding moved into the other parameter group, and stayed at 1.868 GB both ways (to 512
bytes) without them. Without them the bytes are those of the program's own fusions and copies. ``--compiler-defaults`` adds the
figures with the defaults (two more compiles per size).

Attention takes its XLA form in ours (``attention_tpu.xla_form()``): the splash kernels, which
the step takes for bf16 from ``attention_tpu.MIN_SEQUENCE`` tokens on a TPU, are Pallas custom
calls to which the cost analysis gives no bytes and no FLOPs, so a step running them would look
cheaper by hiding its attention. Each program's Pallas kernels and ``while`` loops are counted
(the CI gate, ``tests/compile/test_tpu_cost_gate.py``, wants none of either: a loop's body may be
counted once, not once per trip), and the FLOPs are set against the analytic count
``6 N_matmul tokens + 12 layers batch seq^2 dim`` (every matmul of forward and backward, the
attention's full square as both programs compute it): a program that hid work would fall below.

Sizes: ``w1``, ``350m``, ``1b`` of ``jax_llama.SIZES`` and ``w1-512`` (W1's width, 2 layers,
2 x 512 tokens: attention's share at 512 tokens). Compiles take 30-100 s each for W1 and
several minutes for 350M on a 2-core host. Usage::

    python scripts/tpu_cost.py [--size w1 --size 350m ...] [--target v5e] [--hlo-dir DIR]
                               [--compiler-defaults]

Prints ONE JSON line: the date, commit, target and libtpu version, the gate's limits, and per
size its shape, each program's bytes, FLOPs, kernels, loops and compile seconds, the analytic
FLOPs and the two ratios. ``--hlo-dir`` also writes each optimized program's HLO text there
(``<size>.ours.hlo``, ``<size>.reference.hlo``), to compare where the bytes go.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
# This checkout's tpu_train, also where another one is installed.
sys.path.insert(1, ROOT)

import jax_llama  # noqa: E402
import provenance  # noqa: E402

# The gate: ours may access at most 5 % more bytes and run at most 2 % more FLOPs.
BYTES_LIMIT = 1.05
FLOPS_LIMIT = 1.02
# Sizes the gate checks in CI (a few minutes of compiling on a 2-core host).
GATED = ("w1", "w1-512")
SIZES: dict[str, jax_llama.Size] = {
    **jax_llama.SIZES,
    "w1-512": dataclasses.replace(jax_llama.SIZES["w1"], name="w1-512", n_layers=2, batch=2,
                                  seq=512),
}
DEFAULT_SIZES = ("w1", "w1-512", "350m")
# XLA options both programs compile with (module docstring); libtpu's flag, pinned with it.
OPTIONS = {"xla_msa_enable": False}


def _compile_only_environment() -> None:
    """Compile-only: the step is traced on the CPU client, and libtpu must not look for chips
    or a metadata server on this host (``tpu_train.compile.targets`` does the rest)."""
    for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_TRAIN_PLATFORM", "cpu")):
        os.environ.setdefault(name, value)


def analytic_flops(size: jax_llama.Size) -> float:
    """Forward + backward FLOPs of every matmul: ``6 N_matmul`` per token (weights, the
    output head) and ``12 layers seq dim`` per token for attention's two products over the
    full ``seq x seq`` square (neither program skips the masked half)."""
    cfg = size.config()
    shapes = jax_llama.param_shapes(cfg)
    matmul = sum(s[0] * s[1] for n, s in shapes.items()
                 if len(s) == 2 and not n.startswith("tok_embeddings"))
    return float(size.tokens * (6 * matmul + 12 * cfg.n_layers * size.seq * cfg.dim))


def _program_facts(compiled, seconds: float) -> tuple[dict, str]:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    text = compiled.as_text()
    return {"bytes": float(cost.get("bytes accessed", 0.0)), "flops": float(cost.get("flops", 0.0)),
            "pallas_kernels": text.count('custom_call_target="tpu_custom_call"'),
            "while_loops": text.count(" while("),
            "prefetches": text.count(" copy-start(") + text.count(" slice-start("),
            "compile_s": round(seconds, 1)}, text


def compile_ours(size: jax_llama.Size, target: str = "v5e",
                 options: dict | None = None) -> tuple[dict, str]:
    """``(facts, optimized HLO text)`` of the trainer's bf16 step for ``size``, compiled with
    XLA ``options`` (default :data:`OPTIONS`)."""
    _compile_only_environment()
    import torch

    import tpu_train  # noqa: F401  (the tpu device)
    from tpu_train.compile import lower_train_step
    from tpu_train.models import Llama
    from tpu_train.ops import attention_tpu
    from tpu_train.ops.matmul import get_matmul_precision, set_matmul_precision
    from tpu_train.trainer.optim import parameter_groups
    from tpu_train.trainer.step import causal_lm_loss_sum_and_count

    hyper = jax_llama.Hyper()
    with torch.device("meta"):
        model = Llama(size.config())
        tokens = torch.empty(size.batch, size.seq, dtype=torch.long)
    optimizer = torch.optim.AdamW(parameter_groups(model, hyper.weight_decay), lr=hyper.lr,
                                  betas=(hyper.b1, hyper.b2), eps=hyper.eps)
    started = time.perf_counter()
    previous = get_matmul_precision()
    # Float32 dots as JAX's TPU default (there are none at bf16 compute); the process's own
    # setting comes back after (a test run goes on with it).
    set_matmul_precision("medium")
    try:
        with attention_tpu.xla_form():
            program = lower_train_step(model, optimizer, causal_lm_loss_sum_and_count,
                                       {"tokens": tokens, "labels": tokens.clone()},
                                       max_grad_norm=hyper.max_grad_norm, skip_non_finite=True,
                                       compute_dtype=torch.bfloat16, target=target,
                                       compile=False)
    finally:
        set_matmul_precision(previous)
    compiled = program.lowered.compile(OPTIONS if options is None else options)
    return _program_facts(compiled, time.perf_counter() - started)


def compile_reference(size: jax_llama.Size, target: str = "v5e",
                      options: dict | None = None) -> tuple[dict, str]:
    """``(facts, optimized HLO text)`` of the hand-written JAX step at bf16 for ``size``,
    compiled with XLA ``options`` (default :data:`OPTIONS`)."""
    _compile_only_environment()
    import jax

    from tpu_train.compile.targets import resolve_target

    hyper = jax_llama.Hyper()
    cfg = size.config()
    device = resolve_target(target).devices[0]
    args = jax_llama.abstract_arguments(cfg, size, hyper,
                                        jax.sharding.SingleDeviceSharding(device))
    step = jax_llama.make_train_step(cfg, jax_llama.optimizer(args[0], hyper), precision="bf16")
    started = time.perf_counter()
    compiled = step.lower(*args).compile(OPTIONS if options is None else options)
    return _program_facts(compiled, time.perf_counter() - started)


def compare(name: str, target: str = "v5e", hlo_dir: str | None = None,
            compiler_defaults: bool = False) -> dict:
    """One size's report: its shape, both programs' facts, analytic FLOPs and the ratios
    (with ``compiler_defaults``, also both programs' bytes compiled with XLA's defaults)."""
    size = SIZES[name]
    ours, ours_text = compile_ours(size, target)
    reference, reference_text = compile_reference(size, target)
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        for side, text in (("ours", ours_text), ("reference", reference_text)):
            with open(os.path.join(hlo_dir, f"{name}.{side}.hlo"), "w") as out:
                out.write(text)
    report = {"dim": size.dim, "layers": size.n_layers, "vocab": size.vocab_size,
              "batch": size.batch, "seq": size.seq, "ours": ours, "reference": reference,
              "analytic_flops": analytic_flops(size),
              "bytes_ratio": round(ours["bytes"] / reference["bytes"], 4),
              "flops_ratio": round(ours["flops"] / reference["flops"], 4)}
    if compiler_defaults:
        ours_default = compile_ours(size, target, options={})[0]["bytes"]
        reference_default = compile_reference(size, target, options={})[0]["bytes"]
        report["compiler_defaults"] = {"ours_bytes": ours_default,
                                       "reference_bytes": reference_default,
                                       "bytes_ratio": round(ours_default / reference_default, 4)}
    return report




def _libtpu_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", action="append", choices=tuple(SIZES),
                        help=f"a size to compare (repeatable; default: {' '.join(DEFAULT_SIZES)})")
    parser.add_argument("--target", default="v5e", help="a one-chip TPU name: v5e, v6e, v5p")
    parser.add_argument("--hlo-dir", help="write both optimized programs' HLO text here")
    parser.add_argument("--compiler-defaults", action="store_true",
                        help="also compile both with XLA's default options and report their bytes")
    args = parser.parse_args(argv)
    _compile_only_environment()
    # Nothing runs: a persistent cache would only hold programs for a chip that is not here.
    os.environ["TPU_TRAIN_CACHE_DIR"] = "off"
    from tpu_train.compile.targets import TargetError, libtpu_available, resolve_target

    if not libtpu_available():
        parser.error('libtpu is not installed: pip install -c constraints.txt -e ".[tpu]"')
    try:
        target = resolve_target(args.target)
    except TargetError as error:
        parser.error(str(error))
    if target.num_chips != 1:
        parser.error(f"--target {args.target} has {target.num_chips} chips: name one chip "
                     "(e.g. v5e); both programs are single-device")
    report = {"date": time.strftime("%Y-%m-%d"), "commit": provenance.commit(), "target": target.name,
              "libtpu": _libtpu_version(), "host_cores": os.cpu_count(),
              "options": OPTIONS,
              "limits": {"bytes_ratio": BYTES_LIMIT, "flops_ratio": FLOPS_LIMIT},
              "sizes": {name: compare(name, target.name, args.hlo_dir, args.compiler_defaults)
                        for name in dict.fromkeys(args.size or DEFAULT_SIZES)}}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
