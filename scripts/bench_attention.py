#!/usr/bin/env python
"""Attention benchmark: the project's SDPA lowering, XLA form vs the TPU kernels, forward + backward.

Times what a compiled step differentiates (``tpu_train.ops.attention.attention``, the lowering
of ``_scaled_dot_product_fused_attention_overrideable``, and its custom derivative): the value
and gradients of ``sum(attention(q, k, v) * dO)`` with respect to q, k and v, causal, bf16,
head_dim 64, one jitted program per form:

* ``xla``: the XLA formulation (``attention_tpu.xla_form()``), on any platform;
* ``splash``: JAX's Pallas splash-attention kernels, forward and backward
  (``attention_tpu.kernels()``: also below the rule's ``MIN_SEQUENCE``, to measure where the
  rule should start). They run on a TPU only: elsewhere the figure is null, or, with
  ``--interpret``, Pallas' interpret mode runs them (a check that the script works, not a
  timing).

Shapes ``BxH(KV)xS``: 4x8(4)x256, 8x16(8)x512, 8x16(8)x1024 (the 350M model's attention), and
4x32(8)x2048 (the 1B model's). The forms are interleaved, the order alternating each round; per
shape and form: compile seconds, fastest and median milliseconds; the xla / splash ratios; and
the gradients' normwise difference between the two forms. With ``--documents N`` every row
is packed with N samples of random lengths and attention takes their *document mask* (causal
within each sample, a boolean ``[B, 1, S, S]`` argument of the program): the XLA form applies
it densely, the kernels with the segment ids read from it. With ``--window W`` a token sees
only the last W positions (a sliding window, Mistral's): the mask is also banded, and the
kernels run under ``attention_tpu.sliding_window(W)`` with the splash library's ``LocalMask``.
Prints ONE JSON line. Run from the repository root::

    python scripts/bench_attention.py [--rounds 30] [--shapes 8x16(8)x1024,...] [--interpret]
                                      [--documents 4] [--window 256]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's tpu_train, also where another one is installed
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import provenance  # noqa: E402

DEFAULT_SHAPES = "4x8(4)x256,8x16(8)x512,8x16(8)x1024,4x32(8)x2048"
HEAD_DIM = 64
_SHAPE = re.compile(r"^(\d+)x(\d+)\((\d+)\)x(\d+)$")


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    shapes = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        match = _SHAPE.match(item)
        if not match:
            raise ValueError(f"shape {item!r} is not BxH(KV)xS, e.g. 8x16(8)x1024")
        b, h, kv, s = (int(g) for g in match.groups())
        if h % kv:
            raise ValueError(f"shape {item!r}: {h} heads are not a multiple of {kv} kv heads")
        shapes.append((b, h, kv, s))
    return shapes


def document_mask(batch: int, seq: int, documents: int, seed: int = 0,
                  window: int | None = None):
    """A ``[batch, 1, seq, seq]`` boolean document mask of ``documents`` samples of random
    lengths per row (at least one token each; 0: one sample), within ``window`` positions."""
    import numpy

    rng = numpy.random.default_rng(seed)
    segments = numpy.zeros((batch, seq), numpy.int32)
    for row in range(batch if documents else 0):
        cuts = numpy.sort(rng.choice(numpy.arange(1, seq), documents - 1, replace=False))
        segments[row] = numpy.searchsorted(cuts, numpy.arange(seq), side="right")
    causal = numpy.tri(seq, dtype=bool)
    if window:
        causal &= ~numpy.tri(seq, k=-window, dtype=bool)
    return ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]


def _programs(shape, device, interpret: bool, documents: int = 0, window: int = 0):
    """``{form: (compiled, compile seconds)}`` and the arguments they take."""
    import jax
    import jax.numpy as jnp

    from tpu_train.ops import attention, attention_tpu

    b, h, kv, s = shape
    keys = jax.random.split(jax.random.key(0), 4)
    q, dout = (jax.random.normal(k, (b, h, s, HEAD_DIM), jnp.bfloat16) for k in keys[::3])
    k, v = (jax.random.normal(key, (b, kv, s, HEAD_DIM), jnp.bfloat16) for key in keys[1:3])
    masked = bool(documents or window)
    mask = jnp.asarray(document_mask(b, s, documents, window=window)) if masked else None
    args = [jax.device_put(x, device) for x in (q, k, v, dout)] + (
        [jax.device_put(mask, device)] if masked else [])

    def loss(q_, k_, v_, dout_, mask_=None):
        out = attention.attention(q_, k_, v_, mask_, mask_ is None, None)[0]
        return jnp.sum(out.astype(jnp.float32) * dout_.astype(jnp.float32))

    step = jax.value_and_grad(loss, argnums=(0, 1, 2))
    forms = {"xla": attention_tpu.xla_form}
    if device.platform == "tpu" or interpret:
        forms["splash"] = lambda: attention_tpu.kernels(min_sequence=128, interpret=interpret)
    programs = {}
    for name, context in forms.items():
        started = time.perf_counter()
        # The choice is made while tracing: ahead of time, once, and each form traces its own
        # function (JAX would reuse the trace of one function object for the other form).
        with context(), attention_tpu.sliding_window(window or None):
            compiled = jax.jit(lambda *a: step(*a)).lower(*args).compile()
        programs[name] = (compiled, time.perf_counter() - started)
    return programs, args


def _relative(a, b) -> float:
    import jax.numpy as jnp

    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def bench_shape(shape, device, rounds: int, interpret: bool, documents: int = 0,
                window: int = 0) -> dict:
    import jax

    from tpu_train.ops import attention_tpu

    b, h, kv, s = shape
    programs, args = _programs(shape, device, interpret, documents, window)
    results = {name: program(*args) for name, (program, _) in programs.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in programs}
    order = list(programs)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            started = time.perf_counter()
            jax.block_until_ready(programs[name][0](*args))
            times[name].append((time.perf_counter() - started) * 1e3)
    query, key = jax.ShapeDtypeStruct((b, h, s, HEAD_DIM), "bfloat16"), \
        jax.ShapeDtypeStruct((b, kv, s, HEAD_DIM), "bfloat16")
    masked = bool(documents or window)
    mask = jax.ShapeDtypeStruct((b, 1, s, s), "bool") if masked else None
    report = {"shape": f"{b}x{h}({kv})x{s}", "batch": b, "heads": h, "kv_heads": kv, "seq": s,
              "rule_takes_kernels": attention_tpu.supported(query, key, key, mask, not masked),
              "compile_s": {n: round(p[1], 2) for n, p in programs.items()}}
    for name in ("xla", "splash"):
        report[f"{name}_ms"] = None if name not in times else {
            "min": round(min(times[name]), 4), "median": round(statistics.median(times[name]), 4)}
    if "splash" in times:
        report["xla_over_splash"] = {
            key: round(report["xla_ms"][key] / report["splash_ms"][key], 3)
            for key in ("min", "median")}
        _, xla_grads = results["xla"]
        _, splash_grads = results["splash"]
        report["grad_relative_difference"] = {
            n: round(_relative(a, e), 6) for n, a, e in zip("qkv", splash_grads, xla_grads)}
    else:
        report["xla_over_splash"] = None
    return report




def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed calls per form and shape")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help=f"comma-separated BxH(KV)xS (default {DEFAULT_SHAPES})")
    parser.add_argument("--documents", type=int, default=0,
                        help="packed rows of this many samples: a document mask (0: causal)")
    parser.add_argument("--window", type=int, default=0,
                        help="a sliding window of this many positions (0: none)")
    parser.add_argument("--interpret", action="store_true",
                        help="off a TPU, run the kernels in Pallas' interpret mode (not a timing)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.documents < 0:
        parser.error("--documents must be >= 0 (0: causal attention, no document mask)")
    if args.window < 0:
        parser.error("--window must be >= 0 (0: no sliding window)")
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as error:
        parser.error(f"--shapes: {error}")

    from tpu_train.device import runtime
    from tpu_train.ops import attention_tpu

    device = runtime.jax_device(0)
    report = {"benchmark": "attention_fwd_bwd", "platform": device.platform,
              "device_kind": device.device_kind, "host_cores": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d"), "commit": provenance.commit(), "dtype": "bfloat16",
              "head_dim": HEAD_DIM, "causal": True, "rounds": args.rounds,
              "documents_per_row": args.documents, "window": args.window or None,
              "min_sequence_rule": attention_tpu.MIN_SEQUENCE,
              "splash": ("kernels" if device.platform == "tpu" else
                         "interpret mode (not a timing)" if args.interpret else
                         "not run: the kernels need a TPU (--interpret to check the script)"),
              "shapes": [bench_shape(shape, device, args.rounds, args.interpret, args.documents,
                                     args.window)
                         for shape in shapes]}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
