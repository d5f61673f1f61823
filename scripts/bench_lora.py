#!/usr/bin/env python
"""LoRA step benchmark: the full fine-tuning step of a model vs its LoRA step vs its LoRA step
on an int8 base (``model.base_dtype=int8``), interleaved.

Each mode is the compiled step as ``tpu-train`` builds it (the trainer's own blocks:
``start``, ``build_model`` with the recipe's adapters (an int8 base quantized a tensor at a
time as it is drawn), ``parallelize``, ``build_optimizer``, the layout's ``build_step``), from
one initialization (``trainer.seed``) and on the same random-token batches:

* ``full``: every weight trains (``recipe=llama_finetune``'s step);
* ``lora``: ``recipe=llama_lora``, adapters of ``--rank`` on ``--targets``, the base frozen
  in the weights' dtype;
* ``lora_int8``: the same on an int8 base (frozen linear weights in int8, per-channel scales).

The steps are interleaved, the order rotating by one mode each step, and each is timed until
its loss is read on the host (as ``tpu-train``'s loop reads it). Prints ONE JSON line: per mode
the fastest and median step seconds (the first, which compiles, excluded), tokens/s, MFU by
the *frozen model's* FLOPs ((6 N_matmul + 12 layers seq dim) per token, whichever weights
train: a LoRA step skips the base's weight gradients, a third of them), its ratio to
``full``'s, compile seconds, first / last loss, and the device's memory after its set-up;
``lora_int8`` also reports how far its first logits are from the float base's (max and RMS
over one batch, and the logits' RMS). ``host_peak_gb``: the process's peak resident memory
(GB) at the start (resident then), and while each mode is built on the host (``.build``:
initialized, adapted, an int8 base quantized), placed on the device with its step built
(``.place``) and takes its first step (``.first_step``); each phase's own peak where Linux
lets it be reset (``host_peak_per_phase``), else the peak so far. On the CPU client the
device's arrays and the step's buffers are host memory too. Usage::

    python scripts/bench_lora.py [--size w1|350m|1b|llama3_2_1b|llama3_2_3b|llama3_1_8b]
        [--n-layers N] [--batch B] [--seq S] [--steps N] [--only full,lora,lora_int8]
        [--rank 16] [--targets wq,wk,wv,wo] [--precision bf16|fp32] [--remat full|...]
        [--scan-layers true|false]

``--size`` takes a size of ``scripts/jax_llama.py`` (its batch and length) or a Llama 3
preset (batch 1 x 2048 unless given); ``--n-layers`` shortens the model. Modes whose weights
do not fit the chip together run separately with ``--only``: the full fine-tune of a 1B
holds 16 bytes per parameter, an 8B's only fits as ``--only lora_int8``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = ("full", "lora", "lora_int8")
PRESETS = ("llama3_2_1b", "llama3_2_3b", "llama3_1_8b")


def model_shape(args):
    """(LlamaConfig, batch, seq, model option) of ``--size`` and the shape flags."""
    import jax_llama

    from tpu_train.models import get_config

    if args.size in jax_llama.SIZES:
        size = jax_llama.SIZES[args.size]
        name, option, batch, seq = f"llama_{args.size}", f"llama_{args.size}", size.batch, size.seq
    elif args.size in PRESETS:
        name, option, batch, seq = args.size, args.size, 1, 2048
    else:
        raise SystemExit(f"--size {args.size!r}: choose one of "
                         f"{', '.join([*jax_llama.SIZES, *PRESETS])}")
    batch, seq = args.batch or batch, args.seq or seq
    overrides = {"max_seq_len": seq}
    if args.n_layers:
        overrides["n_layers"] = args.n_layers
    return get_config(name, **overrides), batch, seq, option


def compose(args, option: str, mode: str, batch: int, seq: int):
    from train_step_modes import trainer_config

    extra = [f"data.batch_size={batch}", f"data.seq_len={seq}", "data=synthetic_tokens",
             "trainer.micro_batch_size=null", f"model.max_seq_len={seq}"]
    if args.n_layers:
        extra.append(f"model.n_layers={args.n_layers}")
    if mode != "full":
        extra += ["recipe=llama_lora", f"recipe.lora.rank={args.rank}",
                  f"recipe.lora.targets=[{args.targets}]"]
    if mode == "lora_int8":
        extra.append("model.base_dtype=int8")
    if args.remat:
        extra.append(f"trainer.remat={args.remat}")
    if args.scan_layers is not None:
        extra.append(f"trainer.scan_layers={args.scan_layers}")
    return trainer_config(args.precision, model=option, mode="compiled", extra=tuple(extra))


def build_model(config, seed: int, dtype):
    import torch

    from tpu_train.models import Llama

    with torch.device("meta"):
        model = Llama(config).to(dtype)
    return model.init_weights(seed=seed, device="cpu")


class HostPeak:
    """The peak resident memory of this process over one phase, in GB: Linux's ``VmHWM``,
    reset when a phase starts (``/proc/self/clear_refs``); where that cannot be reset, the
    peak since the process started. On the CPU client the device's arrays are host memory too."""

    def __init__(self):
        self.peaks: dict[str, float] = {}
        self.resettable = _reset_peak()

    def phase(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def measured():
            _reset_peak()
            try:
                yield
            finally:
                self.peaks[name] = round(_status_kb("VmHWM") / 2**20, 3)

        return measured()


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource  # ru_maxrss: kilobytes on Linux

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class Mode:
    """One mode's compiled step, built by the trainer's blocks from a fresh initialization;
    ``host`` records the host's peak memory while it is built and placed."""

    def __init__(self, args, option: str, mode: str, batch: int, seq: int, host: HostPeak):
        import types

        from tpu_train.trainer import setup
        from tpu_train.trainer.lora import apply_lora
        from train_step_modes import device_memory

        cfg = compose(args, option, mode, batch, seq)
        job = setup.start(cfg)
        vocab = types.SimpleNamespace(vocab_size=setup.builders.model_config(cfg).vocab_size)
        adapt = None
        if mode != "full":
            lora = cfg.recipe.lora

            def adapt(model):
                apply_lora(model, list(lora.targets), lora.rank, lora.alpha, lora.dropout)
                return model
        # As tpu-train builds it: an int8 base is quantized a tensor at a time as drawn.
        with host.phase(f"{mode}.build"):
            model = setup.build_model(job, vocab, adapt=adapt)
        with host.phase(f"{mode}.place"):
            layout = setup.parallelize(job, model)
            optimizer = setup.build_optimizer(model, cfg)
            self.step_fn = layout.build_step(job, model, optimizer,
                                             setup.build_scheduler(optimizer, cfg))
            self.step_fn.place()
        self.model, self.memory = model, device_memory()

    def step(self, batch: dict) -> float:
        import torch

        tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
        return float(self.step_fn(tensors)["loss"])

    @property
    def compile_s(self) -> float:
        records = getattr(self.step_fn.compiled, "compilations", [])
        return round(sum(r.total_s for r in records), 3)


def logits_gap(config, batch: dict, precision: str) -> dict:
    """How far the int8 base's logits are from the float base's, on the host CPU (float32
    compute; the device's own rounding is not part of it)."""
    import torch

    from tpu_train.models.lora import quantize_frozen_linears

    reference = build_model(config, 0, torch.bfloat16).float()
    tokens = torch.from_numpy(batch["tokens"][:1, :256])
    with torch.no_grad():
        expected = reference(tokens)
        for p in reference.parameters():
            p.requires_grad_(False)
        quantize_frozen_linears(reference)
        got = reference(tokens)
    diff = (got - expected).float()
    return {"max_abs": float(diff.abs().max()), "rms": float(diff.pow(2).mean().sqrt()),
            "logits_rms": float(expected.pow(2).mean().sqrt()), "tokens": int(tokens.numel())}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="w1")
    parser.add_argument("--n-layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", default=",".join(MODES))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="wq,wk,wv,wo")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--remat", default=None)
    parser.add_argument("--scan-layers", default=None, choices=("true", "false"),
                        help="trainer.scan_layers (default: the trainer's, on from 20 layers; "
                             "an 8B on one 16 GB chip runs unrolled)")
    parser.add_argument("--logits-gap", action="store_true",
                        help="also compare the int8 base's logits with the float base's on "
                             "the host (memory: two copies of the model there)")
    args = parser.parse_args(argv)
    modes = [m for m in args.only.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--only: unknown modes {unknown}; choose among {', '.join(MODES)}")

    from train_step_modes import device_facts

    from tpu_train.models import flops_per_token

    config, batch, seq, option = model_shape(args)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(args.steps):
        t = rng.integers(0, config.vocab_size, size=(batch, seq + 1), dtype=np.int64)
        batches.append({"tokens": t[:, :-1].copy(), "labels": t[:, 1:].copy()})
    facts = device_facts()
    host = HostPeak()
    host.peaks["start"] = round(_status_kb("VmRSS") / 2**20, 3)
    built = {m: Mode(args, option, m, batch, seq, host) for m in modes}
    times: dict[str, list] = {m: [] for m in modes}
    losses: dict[str, list] = {m: [] for m in modes}
    for i, data in enumerate(batches):
        for m in modes[i % len(modes):] + modes[:i % len(modes)]:
            start = time.perf_counter()
            if i == 0:
                with host.phase(f"{m}.first_step"):
                    losses[m].append(built[m].step(data))
            else:
                losses[m].append(built[m].step(data))
            times[m].append(time.perf_counter() - start)
    flops = flops_per_token(config, seq) * batch * seq
    peak = facts["peak_bf16_tflops"]
    report = {"size": args.size, "n_layers": config.n_layers, "batch": batch, "seq": seq,
              "rank": args.rank, "targets": args.targets, "precision": args.precision,
              "remat": args.remat, "steps": args.steps, **facts,
              "host_peak_gb": host.peaks, "host_peak_per_phase": host.resettable, "modes": {}}
    for m in modes:
        steady = times[m][1:] or times[m]
        median = statistics.median(steady)
        report["modes"][m] = {
            "fastest_s": round(min(steady), 5), "median_s": round(median, 5),
            "tokens_per_s": round(batch * seq / median, 1),
            "mfu_frozen_model_flops": round(flops / median / (peak * 1e12), 4) if peak else None,
            "compile_s": built[m].compile_s, "first_loss": losses[m][0],
            "last_loss": losses[m][-1], "memory_after_setup": built[m].memory}
    if "full" in modes:
        for m in modes:
            report["modes"][m]["median_vs_full"] = round(
                report["modes"][m]["median_s"] / report["modes"]["full"]["median_s"], 4)
    if "lora_int8" in modes and args.logits_gap:
        report["modes"]["lora_int8"]["logits_vs_float_base"] = logits_gap(
            config, batches[0], args.precision)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
