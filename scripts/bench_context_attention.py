#!/usr/bin/env python
"""One device's share of context-parallel attention, forward + backward, per shard and kernel.

Under ``parallel.context=N`` each device runs its ``S / N`` queries against the whole
sequence's gathered keys and values: on a TPU through the splash kernels
(``tpu_train.ops.context_attention_tpu.shard_attention``, the mask causal by the queries'
positions), elsewhere blockwise in XLA (``tpu_train.ops.context_attention.shard_attention``,
skipping the key blocks after each query chunk). This times that per-shard program on ONE
device (the gather itself is not in it) for shards ``0`` and ``N - 1`` of a causal sequence:
the value and gradients of ``sum(out * dO)`` for q, k and v, bf16, heads 32 (8 kv), head_dim
128 (Llama-3.1-8B's attention), batch 1. ``--kernel``: ``splash``, ``blockwise`` or ``both``
(the default; the two programs' timed calls interleaved, so drift hits both alike); the
splash kernels need a TPU, or ``--interpret`` (Pallas' interpret mode: correctness, not
speed). The blockwise form is timed in the zig-zag layout the step uses (shard ``i``: chunks
``i`` and ``2N - 1 - i``) and, with ``--contiguous``, in the contiguous one too (shard ``i``:
the ``i``-th ``S / N`` tokens), so the figures say whether a shard waits for another. Prints
ONE JSON line::

    python scripts/bench_context_attention.py [--seq 131072] [--shards 16] [--rounds 5]
        [--kernel both|splash|blockwise] [--contiguous] [--interpret]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's tpu_train, also where another one is installed
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import provenance  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _run(compiled, args) -> float:
    import jax

    started = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return (time.perf_counter() - started) * 1e3


def _summary(times: list[float]) -> dict:
    return {"min_ms": round(min(times), 3), "median_ms": round(statistics.median(times), 3)}


def _inputs(seq: int, shards: int, device):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 4)
    local = seq // shards
    q = jax.random.normal(keys[0], (1, HEADS, local, HEAD_DIM), jnp.bfloat16)
    dout = jax.random.normal(keys[3], (1, HEADS, local, HEAD_DIM), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, KV_HEADS, seq, HEAD_DIM), jnp.bfloat16)
            for key in keys[1:3])
    return [jax.device_put(x, device) for x in (q, k, v, dout)]


def _program(kernel: str, seq: int, shards: int, zigzag: bool):
    """The per-shard value-and-grad program of ``kernel``; its last argument says which
    shard (the query positions for ``blockwise``, the shard's index for ``splash``), the keys
    in the zig-zag layout's order (or, ``blockwise`` only, in the sequence's)."""
    import jax
    import jax.numpy as jnp
    import numpy

    from tpu_train.ops import context_attention, context_attention_tpu

    key_positions = jnp.asarray(context_attention.zigzag_positions(seq, shards) if zigzag
                                else numpy.arange(seq), jnp.int32)
    scale = HEAD_DIM ** -0.5

    def loss(q_, k_, v_, dout_, which):
        if kernel == "splash":
            out = context_attention_tpu.shard_attention(q_, k_, v_, which, shards, scale)[0]
        else:
            out = context_attention.shard_attention(q_, k_, v_, which, key_positions, scale)[0]
        return jnp.sum(out.astype(jnp.float32) * dout_.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _shard_argument(kernel: str, zigzag: bool, seq: int, shards: int, shard: int):
    import jax.numpy as jnp
    import numpy

    from tpu_train.ops.context_attention import zigzag_positions

    if kernel == "splash":
        return jnp.asarray(shard, jnp.int32)
    local = seq // shards
    mine = (zigzag_positions(seq, shards).reshape(shards, local)[shard] if zigzag
            else numpy.arange(shard * local, (shard + 1) * local))
    return jnp.asarray(mine, jnp.int32)


def bench(seq: int, shards: int, rounds: int, device, kernels: list[str],
          contiguous: bool) -> dict:
    """Per program (kernel, layout): compile time and shards 0 and N - 1's timed calls,
    every program's calls of a round made before the next round."""
    args = _inputs(seq, shards, device)
    programs = {}  # name -> (compiled, {shard: last argument})
    out = {}
    for kernel in kernels:
        for zigzag in ((True, False) if contiguous and kernel == "blockwise" else (True,)):
            name = kernel if zigzag else f"{kernel}_contiguous"
            step = _program(kernel, seq, shards, zigzag)
            shard_args = {s: _shard_argument(kernel, zigzag, seq, shards, s)
                          for s in (0, shards - 1)}
            started = time.perf_counter()
            compiled = step.lower(*args, shard_args[0]).compile()
            out[name] = {"compile_s": round(time.perf_counter() - started, 2)}
            programs[name] = (compiled, shard_args)
            for shard, which in shard_args.items():  # warm-up: the first call of each
                _run(compiled, args + [which])
    times = {(name, shard): [] for name, (_, shard_args) in programs.items()
             for shard in shard_args}
    for _ in range(rounds):
        for name, (compiled, shard_args) in programs.items():
            for shard, which in shard_args.items():
                times[name, shard].append(_run(compiled, args + [which]))
    for (name, shard), measured in times.items():
        out[name][f"shard_{shard}"] = _summary(measured)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=32768, help="the whole sequence's tokens")
    parser.add_argument("--shards", type=int, default=8, help="the context degree N")
    parser.add_argument("--rounds", type=int, default=5, help="timed calls per program")
    parser.add_argument("--kernel", choices=("both", "splash", "blockwise"), default="both",
                        help="which per-shard attention to time (both: interleaved)")
    parser.add_argument("--contiguous", action="store_true",
                        help="also time the blockwise form in the contiguous layout")
    parser.add_argument("--interpret", action="store_true",
                        help="the splash kernels in Pallas' interpret mode (any platform)")
    args = parser.parse_args(argv)
    if args.shards < 1 or args.seq % (2 * args.shards):
        parser.error(f"--seq {args.seq} must split into 2 x --shards {args.shards} chunks")
    chunk = args.seq // (2 * args.shards)
    kernels = ["splash", "blockwise"] if args.kernel == "both" else [args.kernel]
    if "splash" in kernels and chunk % 128:
        parser.error(f"--seq {args.seq} / (2 x --shards {args.shards}) = {chunk} tokens per "
                     f"chunk: the splash kernels need a multiple of 128 (use --kernel blockwise)")

    from tpu_train.device import runtime
    from tpu_train.ops import attention_tpu

    device = runtime.jax_device(0)
    if "splash" in kernels and device.platform != "tpu" and not args.interpret:
        parser.error(f"the splash kernels run on a TPU, this device is {device.platform}: "
                     f"pass --interpret, or --kernel blockwise")
    forms = attention_tpu.interpreted() if args.interpret else contextlib.nullcontext()
    report = {"benchmark": "context_attention_shard_fwd_bwd", "platform": device.platform,
              "device_kind": device.device_kind, "host_cores": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d"), "commit": provenance.commit(),
              "dtype": "bfloat16", "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "seq": args.seq, "shards": args.shards, "queries_per_shard": args.seq // args.shards,
              "rounds": args.rounds, "interpret": args.interpret}
    with forms:
        report.update(bench(args.seq, args.shards, args.rounds, device, kernels,
                            args.contiguous))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
