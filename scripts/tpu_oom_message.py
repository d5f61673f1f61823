#!/usr/bin/env python
"""Does XLA's TPU compiler report running out of HBM the same way on a chip as for a compile-only
topology? ``tpu_train.compile.memory_errors`` parses the compile-only v5e's message (the only one
the test suite can provoke). This compiles two pure-JAX programs, the gradient of a stack of
8192 x 8192 bf16 layers (12 layers on 524,288 rows: an 8 GiB input and activations as large,
which cannot fit one v5e; 2 layers on 8,192 rows, which can), for device 0 and for ``v5e:1x1``
without a chip, and prints ONE JSON line: per program and target the compile seconds and memory
analysis, or the error's type and text (compile-only v5e, libtpu 0.0.42.1: "RESOURCE_EXHAUSTED:
Ran out of memory on HBM, the total memory required for HLO temporaries (67.00G) exceeds
available HBM (15.75G)."). Run it on a TPU host (JAX and libtpu; no torch needed)::

    python scripts/tpu_oom_message.py
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
from jax.experimental import topologies


def _loss(weights, x):
    for w in weights:
        x = jnp.tanh(x @ w)
    return jnp.mean(x.astype(jnp.float32) ** 2)


def _compile(device, layers: int, rows: int) -> dict:
    sharding = jax.sharding.SingleDeviceSharding(device)

    def spec(shape):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)

    try:
        started = time.time()
        compiled = jax.jit(jax.grad(_loss)).lower([spec((8192, 8192))] * layers,
                                                  spec((rows, 8192))).compile()
        memory = compiled.memory_analysis()
        return {"seconds": round(time.time() - started, 1), "temp": memory.temp_size_in_bytes,
                "arguments": memory.argument_size_in_bytes}
    except Exception as error:  # the point: what the compiler raises, whatever it is
        return {"type": type(error).__name__, "message": str(error)[:1200]}


def main() -> dict:
    chip = jax.devices()[0]
    report = {"device_kind": chip.device_kind}
    try:
        report["memory"] = {k: v for k, v in chip.memory_stats().items()
                            if "limit" in k or "reserv" in k}
    except Exception as error:  # memory_stats is optional in PJRT plugins
        report["memory"] = repr(error)
    # One chip per host (a v5e host's default bounds are 2x2x1, which 1x1 does not divide).
    compile_only = topologies.get_topology_desc("v5e:1x1", "tpu", chips_per_host_bounds=(1, 1, 1),
                                                num_slices=1).devices[0]
    for name, layers, rows in (("too_big", 12, 524288), ("fits", 2, 8192)):
        for target, device in (("chip", chip), ("compile_only_v5e", compile_only)):
            report[f"{name}_{target}"] = _compile(device, layers, rows)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
