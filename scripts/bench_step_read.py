#!/usr/bin/env python
"""What reading a step's result on the host costs after the step, and giving it its
inputs: four interleaved experiments.

* ``jax_read``: a donated step of 40 float32 arrays (two bf16 dots each, ~2.7 ms on a v5e) in
  plain JAX, its result read on the host four ways, one step each in turn: a scalar or a
  4-vector, read at once (``float`` / ``np.asarray``) or after ``copy_to_host_async()`` right
  after the launch (as the compiled step's metrics are);
* ``jax_input``: a plain-JAX program of ~1 ms whose first op gathers table rows by an int32
  [4, 256] index array (W1's tokens), from the call until its result is ready, the index given
  four ways: a NumPy array (the executable transfers it at the launch, as the compiled step's
  host batch), ``device_put`` right before the call, ``device_put`` ~300 us before (the time
  spun in between not counted) and already on the device: does the first input's transfer
  delay the program?
* ``jax_host_arguments``: that program with two more inputs needed only at its end (W1's
  labels and a [2, 4] float32 array as the step's host scalars), given as three NumPy arrays,
  as one int32 NumPy array the program unpacks (one transfer instead of three), the index alone
  from the host, or all on the device already: what does each host argument cost?
* ``w1``: the trainer's W1 step (``scripts/train_step_modes.py``, as ``bench_train_step.py
  --size w1`` runs it) and the JAX reference, interleaved, with variants of the trainer's step
  that each change one thing around the same program: ``no_early_copy``
  (``jax.Array.copy_to_host_async`` a no-op: the metrics are read without the copy started at the
  launch), ``batch_on_device`` (the batch moved to the device before the call, as the reference
  puts its batch before its call, instead of the program's own transfer of host arrays),
  ``inputs_on_device`` (that, and the step's host scalars put on the device before the call too:
  no host argument left) and ``gc_off`` (Python's cyclic garbage collector off during the
  step). The step does not read its finiteness flag in the call: the loss read after it is the
  step's one wait, as the reference's is (``bench_step_parts.py`` times a step that does).

Each step is timed until its value is on the host; min and median in ms (the first 5 steps of
each left out) and, for ``w1``, each median over JAX's. Prints ONE JSON line. Usage::

    python scripts/bench_step_read.py [--dim 1024] [--steps 160] [--w1-steps 90]
                                      [--input-steps 160]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

WARMUP = 5


def figures(seconds: list) -> dict:
    timed = seconds[WARMUP:]
    return {"min_ms": round(min(timed) * 1e3, 3),
            "median_ms": round(statistics.median(timed) * 1e3, 3)}


def interleaved(variants: dict, steps: int, run_one) -> dict:
    """``steps`` rounds, one step of every variant per round, the order rotating."""
    times = {name: [] for name in variants}
    names = list(variants)
    for i in range(steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            run_one(name, i)
            times[name].append(time.perf_counter() - start)
    return {name: figures(t) for name, t in times.items()}


def jax_read(dim: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    state = {"params": [jax.device_put(np.full((dim, dim), 1e-3 * (i + 1), np.float32), device)
                        for i in range(40)]}

    def step(params, x):
        new, total = [], jnp.float32(0)
        for p in params:
            half = p.astype(jnp.bfloat16)
            h = jnp.dot(half, half, preferred_element_type=jnp.float32)
            h = jnp.dot(h.astype(jnp.bfloat16), half, preferred_element_type=jnp.float32)
            total = total + jnp.mean(h)
            new.append(p - 1e-6 * h)
        loss = total + x
        return new, loss, jnp.stack([loss, 2 * total, x, jnp.isfinite(loss).astype(jnp.float32)])

    x = jax.device_put(np.float32(1), device)
    program = jax.jit(step, donate_argnums=0).lower(state["params"], x).compile()
    reads = {
        "scalar": lambda out: float(out[1]),
        "scalar_early_copy": lambda out: (out[1].copy_to_host_async(), float(out[1])),
        "vector": lambda out: bool(np.asarray(out[2])[3]),
        "vector_early_copy": lambda out: (out[2].copy_to_host_async(),
                                          bool(np.asarray(out[2])[3])),
    }

    def run_one(name, _):
        out = program(state["params"], x)
        state["params"] = out[0]
        reads[name](out)

    return interleaved(reads, steps, run_one)


def jax_input(steps: int) -> dict:
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    table = jax.device_put(np.full((8192, 512), 0.01, np.float32), device)
    weight = jax.device_put(np.full((512, 512), 0.01, np.float32), device)

    @jax.jit
    def program(index, table, weight):
        x = table[index.reshape(-1)]  # the first op needs the index
        for _ in range(24):
            x = jnp.tanh(x @ weight)
        return x.sum()

    index = np.random.default_rng(0).integers(0, 8192, (4, 256)).astype(np.int32)
    resident = jax.device_put(index, device)
    for argument in (index, resident):
        jax.block_until_ready(program(argument, table, weight))
    spun = {"seconds": 0.0}

    def put_early():
        put = jax.device_put(index, device)
        start = time.perf_counter()
        while time.perf_counter() - start < 300e-6:
            pass
        spun["seconds"] = time.perf_counter() - start
        return put

    givens = {"numpy": lambda: index, "put_at_call": lambda: jax.device_put(index, device),
              "put_300us_before": put_early, "resident": lambda: resident}
    times = {name: [] for name in givens}
    names = list(givens)
    for i in range(steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            spun["seconds"] = 0.0
            start = time.perf_counter()
            jax.block_until_ready(program(givens[name](), table, weight))
            times[name].append(time.perf_counter() - start - spun["seconds"])
    return {name: figures(t) for name, t in times.items()}


def jax_host_arguments(steps: int) -> dict:
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    table = jax.device_put(np.full((8192, 512), 0.01, np.float32), device)
    weight = jax.device_put(np.full((512, 512), 0.01, np.float32), device)

    def body(index, labels, scalars, table, weight):
        x = table[index.reshape(-1)]  # the first op needs the index
        for _ in range(24):
            x = jnp.tanh(x @ weight)
        # the labels and scalars are needed last, as a step's loss and update need them
        return x.sum() * scalars[1, 2] + labels.astype(jnp.float32).sum()

    program = jax.jit(body)
    tokens = np.prod((4, 256))

    @jax.jit
    def packed_program(packed, table, weight):
        index = packed[:tokens].reshape(4, 256)
        labels = packed[tokens:2 * tokens].reshape(4, 256)
        scalars = jax.lax.bitcast_convert_type(packed[2 * tokens:], jnp.float32).reshape(2, 4)
        return body(index, labels, scalars, table, weight)

    rng = np.random.default_rng(0)
    index = rng.integers(0, 8192, (4, 256)).astype(np.int32)
    labels = rng.integers(0, 8192, (4, 256)).astype(np.int32)
    scalars = np.linspace(0.5, 1.0, 8, dtype=np.float32).reshape(2, 4)
    on = {name: jax.device_put(a, device) for name, a in
          (("index", index), ("labels", labels), ("scalars", scalars))}

    def pack():
        return np.concatenate([index.reshape(-1), labels.reshape(-1),
                               scalars.reshape(-1).view(np.int32)])

    runs = {"three_host": lambda: program(index, labels, scalars, table, weight),
            "one_host_packed": lambda: packed_program(pack(), table, weight),
            "index_host": lambda: program(index, on["labels"], on["scalars"], table, weight),
            "resident": lambda: program(on["index"], on["labels"], on["scalars"], table,
                                        weight)}
    for run in runs.values():
        jax.block_until_ready(run())
    return interleaved(runs, steps, lambda name, _: jax.block_until_ready(runs[name]()))


def w1(steps: int) -> dict:
    import jax
    import torch

    from tpu_train.compile import train_step as train_step_module

    import train_step_modes as tsm

    ours, reference, batches = tsm.w1_pair(steps)
    array_type = type(jax.device_put(np.float32(0)))  # jax.Array's concrete class
    early_copy = array_type.copy_to_host_async
    device = torch.device("tpu", 0)

    def on_device(batch):
        return {k: torch.from_numpy(np.asarray(v, dtype=np.int64)).to(device)
                for k, v in batch.items()}

    host_scalars = train_step_module.host_scalars
    scalars_device = jax.devices()[0]

    def scalars_on_device(optimizer, adapter):
        scalars, steps = host_scalars(optimizer, adapter)
        return jax.device_put(scalars, scalars_device), steps

    # name: (mode, copy_to_host_async during the step, how the batch is given, the host
    # scalars' function, gc off)
    modes = {"compiled": (ours, early_copy, None, host_scalars, False),
             "compiled_no_early_copy": (ours, lambda self: None, None, host_scalars, False),
             "compiled_batch_on_device": (ours, early_copy, on_device, host_scalars, False),
             "compiled_inputs_on_device": (ours, early_copy, on_device, scalars_on_device,
                                           False),
             "compiled_gc_off": (ours, early_copy, None, host_scalars, True),
             "jax": (reference, early_copy, None, host_scalars, False)}

    def run_one(name, i):
        mode, copy, place, scalars_fn, gc_off = modes[name]
        array_type.copy_to_host_async = copy
        train_step_module.host_scalars = scalars_fn
        if gc_off:
            gc.disable()
        try:
            if place is None:
                mode.block(mode.step(batches[i]))
            else:  # the trainer's step takes device tensors as they are
                mode.block(mode.train_step(place(batches[i]))["loss"])
        finally:
            array_type.copy_to_host_async = early_copy
            train_step_module.host_scalars = host_scalars
            gc.enable()

    result = interleaved(modes, steps, run_one)
    jax_median = result["jax"]["median_ms"]
    return {**result, "median_over_jax": {name: round(r["median_ms"] / jax_median, 3)
                                          for name, r in result.items()}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024, help="the plain-JAX step's array side")
    parser.add_argument("--steps", type=int, default=160, help="plain-JAX rounds")
    parser.add_argument("--w1-steps", type=int, default=90, help="W1 rounds (0: skip)")
    parser.add_argument("--input-steps", type=int, default=160,
                        help="first-input rounds (0: skip)")
    args = parser.parse_args(argv)
    import train_step_modes as tsm

    import tpu_train  # noqa: F401  (the platform TPU_TRAIN_PLATFORM names)

    report = {**tsm.device_facts(), "date": time.strftime("%Y-%m-%d"),
              "jax_read": jax_read(args.dim, args.steps)}
    if args.input_steps:
        report["jax_input"] = jax_input(args.input_steps)
        report["jax_host_arguments"] = jax_host_arguments(args.input_steps)
    if args.w1_steps:
        report["w1"] = w1(args.w1_steps)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
