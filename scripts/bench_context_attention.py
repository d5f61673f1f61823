#!/usr/bin/env python
"""One device's share of context-parallel attention, forward + backward, per shard and layout.

Under ``parallel.context=N`` each device runs ``tpu_train.ops.context_attention
.shard_attention``: its ``S / N`` queries against the whole sequence's gathered keys and
values, blockwise, skipping the key blocks after each query chunk. This times that per-shard
program on ONE device (the gather itself is not in it) for shards ``0`` and ``N - 1`` of a
causal sequence, in the zig-zag layout the step uses (shard ``i``: chunks ``i`` and
``2N - 1 - i``) and in the contiguous one (shard ``i``: the ``i``-th ``S / N`` tokens), so the
figures say whether a shard waits for another: the value and gradients of
``sum(out * dO)`` for q, k and v, bf16, heads 32 (8 kv), head_dim 128 (Llama-3.1-8B's
attention), batch 1. Prints ONE JSON line::

    python scripts/bench_context_attention.py [--seq 32768] [--shards 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
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


def _timed(compiled, args, rounds: int) -> dict:
    import jax

    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - started) * 1e3)
    return {"min_ms": round(min(times), 3), "median_ms": round(statistics.median(times), 3)}


def _shard_program(seq: int, shards: int, zigzag: bool, device):
    """The per-shard value-and-grad program (the query positions its last argument) and its
    other arguments; the keys in the zig-zag layout's order or in the sequence's."""
    import jax
    import jax.numpy as jnp
    import numpy

    from tpu_train.ops.context_attention import shard_attention, zigzag_positions

    keys = jax.random.split(jax.random.key(0), 4)
    local = seq // shards
    q = jax.random.normal(keys[0], (1, HEADS, local, HEAD_DIM), jnp.bfloat16)
    dout = jax.random.normal(keys[3], (1, HEADS, local, HEAD_DIM), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, KV_HEADS, seq, HEAD_DIM), jnp.bfloat16)
            for key in keys[1:3])
    key_positions = jnp.asarray(zigzag_positions(seq, shards) if zigzag
                                else numpy.arange(seq), jnp.int32)

    def loss(q_, k_, v_, dout_, mine):
        out = shard_attention(q_, k_, v_, mine, key_positions, HEAD_DIM ** -0.5)[0]
        return jnp.sum(out.astype(jnp.float32) * dout_.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return step, [jax.device_put(x, device) for x in (q, k, v, dout)]


def bench(seq: int, shards: int, rounds: int, device) -> dict:
    import jax.numpy as jnp
    import numpy

    from tpu_train.ops.context_attention import zigzag_positions

    local = seq // shards
    zigzag = zigzag_positions(seq, shards).reshape(shards, local)
    layouts = {"zigzag": (True, lambda i: zigzag[i]),
               "contiguous": (False, lambda i: numpy.arange(i * local, (i + 1) * local))}
    out = {}
    for layout, (zigzag_keys, mine) in layouts.items():
        step, args = _shard_program(seq, shards, zigzag_keys, device)
        started = time.perf_counter()
        compiled = step.lower(*args, jnp.asarray(mine(0), jnp.int32)).compile()
        compile_s = time.perf_counter() - started
        out[layout] = {"compile_s": round(compile_s, 2)}
        for shard in (0, shards - 1):
            positions = jnp.asarray(mine(shard), jnp.int32)
            out[layout][f"shard_{shard}"] = _timed(compiled, args + [positions], rounds)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=32768, help="the whole sequence's tokens")
    parser.add_argument("--shards", type=int, default=8, help="the context degree N")
    parser.add_argument("--rounds", type=int, default=5, help="timed calls per program")
    args = parser.parse_args(argv)
    if args.shards < 1 or args.seq % (2 * args.shards):
        parser.error(f"--seq {args.seq} must split into 2 x --shards {args.shards} chunks")

    from tpu_train.device import runtime

    device = runtime.jax_device(0)
    report = {"benchmark": "context_attention_shard_fwd_bwd", "platform": device.platform,
              "device_kind": device.device_kind, "host_cores": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d"), "commit": provenance.commit(),
              "dtype": "bfloat16", "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "seq": args.seq, "shards": args.shards, "queries_per_shard": args.seq // args.shards,
              "rounds": args.rounds, **bench(args.seq, args.shards, args.rounds, device)}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
