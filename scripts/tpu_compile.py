#!/usr/bin/env python
"""Compile the trainer's train step for a TPU with XLA's TPU compiler, on any host: no chip.

Needs libtpu (``pip install -c constraints.txt -e ".[tpu]"``); the step is lowered on this
host's CPU client and compiled for ``--target`` (``tpu_train.compile.targets``), never run.
The step is the one ``tpu-train`` builds: AdamW, clipping to 1.0, skip-non-finite, and for
``--precision bf16`` bfloat16 compute with float32 master weights.

``--size default`` is the bundled default job's model and batch (``model=debug_tiny``, 16 x
128); ``w1``, ``350m``, ``1b`` are the sizes of ``scripts/jax_llama.py``; ``--seq``,
``--batch`` and ``--layers`` change that size's sequence length, batch and depth. Prints ONE
JSON line: trace / lower / XLA compile seconds (and the compile's CPU seconds, all threads:
``xla_compile_cpu_s``, steadier than wall seconds on a loaded host), the TPU compiler's bytes accessed, FLOPs and
peak memory per chip, the optimized program's fusion, dot and Pallas kernel counts, and its
entry parameters against the arguments the step passes (never more: XLA drops unread ones). Usage::

    python scripts/tpu_compile.py [--size default|w1|350m|1b] [--precision fp32|bf16]
                                  [--matmul-precision highest|high|medium] [--target v5e]
                                  [--seq N] [--batch N] [--layers N]
                                  [--remat none|full|save_dots|save_qkv_proj|offload]
                                  [--scan-layers auto|true|false] [--state-dtype param|bf16]
                                  [--param-dtype fp32|bf16]
                                  [--compile-log]
                                  [--program ours|jax|jax_scan] [--hlo-dir DIR]

``--program jax`` compiles the hand-written JAX step of the same size instead
(``scripts/jax_llama.py``, unrolled, no remat), ``jax_scan`` MaxText's shape of it
(``scripts/jax_llama_scan.py``: scanned layers, remat ``dots`` or ``--remat full``, splash
attention from seq 1,024), both at bf16 with optax AdamW and clipping.

``--compile-log`` adds ``compile_log``: the TPU compiler's own account of the compile (its
stages' seconds, bundle count, executable fingerprint and slowest kernels, from libtpu's log;
``scripts/tpu_compile_log.py``). Equal fingerprints mean the same device program.
``by_computation`` sums the kernels by part of the optimized program: the entry computation
and each ``while`` loop (a scanned stack's forward and backward bodies are compiled once).
``--hlo-dir DIR`` writes the program's input StableHLO and XLA's optimized HLO there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# This checkout's tpu_train, also where another one is installed.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Compile-only: libtpu must not look for chips or a metadata server on this host, and other
# processes (a test run) may have loaded it too. The step itself is traced on the CPU client.
for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                    ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_TRAIN_PLATFORM", "cpu")):
    os.environ.setdefault(name, value)


def build(size: str, seq: int | None = None, batch_size: int | None = None,
          layers: int | None = None):
    """``(model on meta, batch of meta tensors)`` for ``size`` (its sequence length, batch and
    layer count replaced where given)."""
    import dataclasses

    import torch

    from tpu_train.models import CONFIGS, Llama

    if size == "default":
        config, batch, default_seq = CONFIGS["debug_tiny"], 16, 128
    else:
        import jax_llama

        shape = jax_llama.SIZES[size]
        config, batch, default_seq = shape.config(), shape.batch, shape.seq
    seq, batch = seq or default_seq, batch_size or batch
    config = dataclasses.replace(config, max_seq_len=max(config.max_seq_len, seq),
                                 n_layers=layers or config.n_layers)
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
    parser.add_argument("--seq", type=int, help="sequence length (default: the size's)")
    parser.add_argument("--batch", type=int, help="sequences per step (default: the size's)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the size's)")
    parser.add_argument("--remat",
                        choices=("none", "full", "save_dots", "save_qkv_proj", "offload"),
                        default="none", help="what each layer keeps for its backward "
                                             "(trainer.remat)")
    parser.add_argument("--scan-layers", choices=("auto", "true", "false"), default="auto",
                        help="trainer.scan_layers (auto: stacks of 20 layers or more)")
    parser.add_argument("--state-dtype", choices=("param", "bf16"), default="param",
                        help="AdamW's moments in the parameters' dtype or bf16 "
                             "(optim.state_dtype)")
    parser.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the stored weights' dtype (trainer.param_dtype)")
    parser.add_argument("--compile-log", action="store_true",
                        help="report the TPU compiler's stages and slowest kernels")
    parser.add_argument("--program", choices=("ours", "jax", "jax_scan"), default="ours",
                        help="the trainer's step, or the JAX reference unrolled or scanned")
    parser.add_argument("--hlo-dir", help="write the program's input StableHLO and XLA's "
                                          "optimized HLO here (<program>.stablehlo.mlir, "
                                          "<program>.optimized.hlo)")
    args = parser.parse_args(argv)
    log_dir = enable_compile_log(os.environ) if args.compile_log else None
    for name in ("seq", "batch", "layers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")

    if args.program != "ours":
        report = compile_reference(args)
        compiled = report.pop("_compiled")
        write_hlo(args, report.pop("_lowered"), compiled)
        if log_dir is not None:
            report["compile_log"] = read_compile_log(log_dir, compiled.as_text())
        print(json.dumps(report))
        return report

    import torch

    import tpu_train  # noqa: F401
    from tpu_train.compile import lower_train_step
    from tpu_train.compile.cache import TimedStages
    from tpu_train.compile.program import compile_program
    from tpu_train.compile.targets import TargetError, libtpu_available
    from tpu_train.ops.matmul import set_matmul_precision
    from tpu_train.models import LLAMA
    from tpu_train.parallel.activation_checkpointing import apply_activation_checkpointing
    from tpu_train.trainer.step import causal_lm_loss_sum_and_count

    if not libtpu_available():
        parser.error('libtpu is not installed: pip install -c constraints.txt -e ".[tpu]"')
    set_matmul_precision(args.matmul_precision)
    model, batch = build(args.size, args.seq, args.batch, args.layers)
    if args.param_dtype == "bf16":
        model = model.to(torch.bfloat16)
    apply_activation_checkpointing(model, args.remat, qkv_projections=LLAMA.qkv_projections)
    scan_layers = {"auto": None, "true": True, "false": False}[args.scan_layers]
    if args.state_dtype == "bf16":
        from tpu_train.compile.stored_moments import stored_moments_class

        optimizer = stored_moments_class(torch.optim.AdamW)(
            model.parameters(), lr=1e-4, weight_decay=0.1, state_dtype=torch.bfloat16)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    bf16 = torch.bfloat16 if args.precision == "bf16" else None
    started = time.perf_counter()
    try:
        program = lower_train_step(model, optimizer, causal_lm_loss_sum_and_count, batch,
                                   max_grad_norm=1.0, skip_non_finite=True, target=args.target,
                                   autocast_dtype=bf16, compute_dtype=bf16,
                                   scan_layers=scan_layers, compile=False)
    except TargetError as error:
        parser.error(str(error))
    # Compiled here (what compile=True does) to time the compile's CPU seconds on their own.
    stages, cpu_started = TimedStages(), time.process_time()
    compile_program(program, stages)
    compile_cpu_s = time.process_time() - cpu_started
    program.seconds = {**program.seconds, "compile": stages.seconds["compile"]}
    text = program.executable.as_text()
    write_hlo(args, program.lowered, program.executable)
    tokens = batch["tokens"].shape
    report = {"size": args.size, "batch": tokens[0], "seq": tokens[1],
              "layers": model.config.n_layers, "precision": args.precision,
              "remat": args.remat, "scan_layers": args.scan_layers,
              "state_dtype": args.state_dtype, "param_dtype": args.param_dtype,
              "matmul_precision": args.matmul_precision, "target": args.target,
              "date": time.strftime("%Y-%m-%d"), "host_cores": os.cpu_count(),
              "seconds": {k: round(v, 2) for k, v in program.seconds.items()},
              "xla_compile_cpu_s": round(compile_cpu_s, 1),
              "wall_s": round(time.perf_counter() - started, 2), **program.analysis(),
              "fusions": text.count(" fusion("),
              "dots": text.count(" convolution(") + text.count(" dot("),
              "pallas_kernels": text.count('custom_call_target="tpu_custom_call"'),
              **_parameter_counts(program, text)}
    if log_dir is not None:
        report["compile_log"] = read_compile_log(log_dir, text)
    print(json.dumps(report))
    return report


def compile_reference(args) -> dict:
    """The JAX reference's step (``--program jax|jax_scan``) compiled for ``args.target``."""
    import dataclasses

    import jax

    import jax_llama
    import jax_llama_scan
    from tpu_train.compile.targets import resolve_target

    size = jax_llama.SIZES["w1" if args.size == "default" else args.size]
    size = dataclasses.replace(size, **{k: v for k, v in (("seq", args.seq),
                                                          ("batch", args.batch),
                                                          ("n_layers", args.layers))
                                        if v is not None})
    hyper, cfg = jax_llama.Hyper(), size.config()
    device = resolve_target(args.target).devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    remat = {"none": None, "full": "full"}.get(args.remat, "dots")
    started = time.perf_counter()
    if args.program == "jax":
        params_args = jax_llama.abstract_arguments(cfg, size, hyper, sharding)
        step = jax_llama.make_train_step(cfg, jax_llama.optimizer(params_args[0], hyper),
                                         precision="bf16", remat=remat)
    else:
        remat = remat or "dots"
        params_args = jax_llama_scan.abstract_arguments(cfg, size, hyper, sharding)
        step = jax_llama_scan.make_train_step(
            cfg, jax_llama_scan.optimizer(params_args[0], hyper), precision="bf16",
            remat=remat, splash=jax_llama_scan.uses_splash("tpu", size.seq))
    lowered = step.lower(*params_args)
    lowered_at, cpu_started = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    done, compile_cpu_s = time.perf_counter(), time.process_time() - cpu_started
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, (list, tuple)) else cost
    memory = compiled.memory_analysis()
    return {"program": args.program, "size": size.name, "batch": size.batch, "seq": size.seq,
            "layers": size.n_layers, "precision": "bf16", "remat": remat,
            "target": args.target, "date": time.strftime("%Y-%m-%d"),
            "host_cores": os.cpu_count(),
            "seconds": {"trace_lower": round(lowered_at - started, 2),
                        "xla_compile": round(done - lowered_at, 2)},
            "xla_compile_cpu_s": round(compile_cpu_s, 1),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "flops": float(cost.get("flops", 0.0)),
            "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
            "fusions": text.count(" fusion("),
            "dots": text.count(" convolution(") + text.count(" dot("),
            "pallas_kernels": text.count('custom_call_target="tpu_custom_call"'),
            "while_loops": text.count(" while("),
            "_lowered": lowered, "_compiled": compiled}


def write_hlo(args, lowered, compiled) -> None:
    """With ``--hlo-dir``: the input StableHLO and the optimized HLO, named by program."""
    if not args.hlo_dir:
        return
    os.makedirs(args.hlo_dir, exist_ok=True)
    for suffix, text in (("stablehlo.mlir", lowered.as_text()),
                         ("optimized.hlo", compiled.as_text())):
        with open(os.path.join(args.hlo_dir, f"{args.program}.{suffix}"), "w") as out:
            out.write(text)


def enable_compile_log(environ) -> str:
    """Make libtpu (not started yet) log its compile into a new directory, naming the kernels
    it compiles; returns the directory."""
    import tempfile

    import tpu_compile_log

    log_dir = tempfile.mkdtemp(prefix="tpu_compile_log.")
    environ["TPU_LOG_DIR"] = log_dir
    environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # libtpu's INFO lines hold the stage durations
    environ["LIBTPU_INIT_ARGS"] = " ".join(
        filter(None, (environ.get("LIBTPU_INIT_ARGS", ""), tpu_compile_log.LIBTPU_ARGS)))
    return log_dir


def read_compile_log(log_dir: str, hlo_text: str | None = None,
                     wait_s: float = 10.0) -> dict | None:
    """:func:`tpu_compile_log.summarize` of libtpu's INFO log in ``log_dir`` (None: no log),
    once the compile's last line is there (at most ``wait_s`` seconds later); with the
    optimized program's ``hlo_text``, also its kernels by part of the program
    (``by_computation``: :func:`tpu_compile_log.kernels_by_computation`)."""
    import tpu_compile_log

    path = os.path.join(log_dir, "tpu_driver.INFO")
    # libtpu may still be writing the compile's last lines (or opening its log) when the
    # compile returns.
    deadline = time.monotonic() + wait_s
    while True:
        text = None
        if os.path.exists(path):
            with open(path, errors="replace") as log:
                text = log.read()
        if text is not None and (tpu_compile_log.FINAL_LINE in text
                                 or time.monotonic() > deadline):
            summary = tpu_compile_log.summarize(text)
            if hlo_text is not None:
                summary["by_computation"] = tpu_compile_log.kernels_by_computation(text,
                                                                                   hlo_text)
            return summary
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)


def _parameter_counts(program, text: str) -> dict:
    """The optimized program's entry parameters and the step's flat arguments. XLA drops
    unused arguments, so the first may be smaller; larger means the program holds values the
    call never passes (a value captured from another trace), and its first call fails with
    "Computation compiled for N inputs but called with M"."""
    import jax

    entry = text.split("\nENTRY", 1)[1].split("\n}", 1)[0]
    return {"entry_parameters": entry.count(" parameter("),
            "step_arguments": len(jax.tree_util.tree_leaves(program.lowered.args_info))}


if __name__ == "__main__":
    main()
