#!/usr/bin/env python
"""Mixture-of-experts benchmark: the compiled training step of one Mixtral-shaped model with its
experts computed in the ``dense`` form (every expert on every token, weighted) and in the
``grouped`` form (tokens sorted by expert, one grouped matmul lowered to
``jax.lax.ragged_dot``), interleaved.

Both models start from the same weights and see the same batches; each step runs both forms,
the order alternating (dense, grouped; grouped, dense; ...), so machine noise hits both alike.
The step is ``tpu_train.compile.compile_train_step`` of AdamW on the loss ``tpu-train`` trains
a Mixtral with (cross-entropy plus ``router_aux_loss_coef`` times the load-balancing loss),
under bf16 autocast (``--precision fp32`` for float32), timed until its loss is read on the
host. Step 1 (which compiles) is excluded.

Prints ONE JSON line: per form the fastest and median step seconds, tokens/s and MFU at the
median (active parameters: ``tpu_train.models.mixtral.flops_per_token``, 2 of the 8 experts; null
where the chip's peak is unknown), compile seconds, first and last loss; the grouped/dense
median ratio, and the largest difference of the two forms' losses (the same training: it
should stay at the precision's rounding). Usage::

    python scripts/bench_moe.py [--size small|tiny] [--steps N] [--precision bf16|fp32]

``small`` (the default): dim 768, 4 layers, 8 experts of width 2688, top-2, vocabulary 32000,
batch 8 x 1024 tokens (255 M parameters, 72 M active per token): two copies with AdamW state fit
one 16 GB chip. ``tiny``: ``mixtral_tiny`` at batch 8 x 64, a CPU smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZES = {
    "small": (dict(dim=768, n_layers=4, n_heads=12, n_kv_heads=4, vocab_size=32000,
                   ffn_hidden_dim=2688, max_seq_len=1024, n_experts=8, top_k=2), 8, 1024),
    "tiny": (None, 8, 64),
}


def _config(size: str):
    from tpu_train.models import MixtralConfig, named_config

    fields, batch, seq = SIZES[size]
    config = named_config("mixtral_tiny") if fields is None else MixtralConfig(**fields)
    return dataclasses.replace(config, max_seq_len=seq), batch, seq


def _loss(model, batch):
    import torch.nn.functional as F

    logits, aux = model(batch["tokens"], return_aux_loss=True)
    ce = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
    return ce + model.aux_loss_weight * aux.float()


def _build(config, impl: str, state: dict, device, precision: str):
    import torch

    from tpu_train.compile import compile_train_step
    from tpu_train.models import Mixtral

    model = Mixtral(dataclasses.replace(config, moe_impl=impl))
    model.load_state_dict(state)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    dtype = torch.bfloat16 if precision == "bf16" else None
    return compile_train_step(model, optimizer, _loss, max_grad_norm=1.0, autocast_dtype=dtype)


def _batches(steps: int, vocab: int, batch: int, seq: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        t = rng.integers(0, vocab, size=(batch, seq + 1), dtype=np.int64)
        out.append({"tokens": t[:, :-1].copy(), "labels": t[:, 1:].copy()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()

    import torch

    import tpu_train
    from tpu_train.models import Mixtral
    from tpu_train.models.mixtral import flops_per_token
    from train_step_modes import device_facts

    config, batch, seq = _config(args.size)
    device = tpu_train.device(0)
    with torch.device("meta"):
        init = Mixtral(config)
    state = init.init_weights(seed=0, device="cpu").state_dict()
    forms = ("dense", "grouped")
    steps = {}
    compile_s = {}
    for impl in forms:
        started = time.perf_counter()
        steps[impl] = _build(config, impl, state, device, args.precision)
        compile_s[impl] = time.perf_counter() - started  # completed at the first call below
    times = {impl: [] for impl in forms}
    losses = {impl: [] for impl in forms}
    for i, host in enumerate(_batches(args.steps, config.vocab_size, batch, seq)):
        order = forms if i % 2 == 0 else forms[::-1]
        for impl in order:
            placed = {k: torch.from_numpy(v).to(device) for k, v in host.items()}
            started = time.perf_counter()
            out = steps[impl](placed)
            loss = float(out["loss"])
            elapsed = time.perf_counter() - started
            if i == 0:
                compile_s[impl] += elapsed
            else:
                times[impl].append(elapsed)
            losses[impl].append(loss)

    facts = device_facts()
    peak = facts["peak_bf16_tflops"]
    flops = flops_per_token(config, seq) * batch * seq
    report = {"benchmark": "bench_moe", "size": args.size, "precision": args.precision,
              "batch": batch, "seq": seq, "n_experts": config.n_experts, "top_k": config.top_k,
              "timed_steps": args.steps - 1, **facts}
    for impl in forms:
        median = statistics.median(times[impl])
        report[impl] = {
            "step_s_min": min(times[impl]), "step_s_median": median,
            "tokens_per_s": batch * seq / median,
            "mfu": None if peak is None else flops / median / (peak * 1e12),
            "compile_s": compile_s[impl],
            "loss_first": losses[impl][0], "loss_last": losses[impl][-1],
        }
    report["grouped_over_dense"] = (report["grouped"]["step_s_median"]
                                    / report["dense"]["step_s_median"])
    report["max_loss_difference"] = max(abs(a - b) for a, b in zip(*losses.values()))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
