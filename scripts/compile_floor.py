#!/usr/bin/env python
"""What the smallest program costs to compile on this host, by stage.

The eager path, the test suite and a model's first step pay one XLA compile per new program;
for one-op programs that cost is a floor set by the host, not by the program. For ``sin`` of a
small float32 array (``--shapes`` different shapes, so that nothing is reused), this times:
JAX's lowering; ``compile()`` of the lowered program (XLA's compile and the load onto the
device); running it the first and second time; serializing the executable and loading it back
(what a persistent-cache hit costs beyond reading the file).
Where the platform is a TPU, the same program is also compiled for a compile-only v5e topology
in the same process, which tells XLA's own compile from the device's part. Prints ONE JSON
line: per stage the median and fastest milliseconds, and the serialized executable's size::

    python scripts/compile_floor.py [--shapes 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=int, default=20)
    args = parser.parse_args(argv)
    if args.shapes < 1:
        parser.error(f"--shapes {args.shapes}: give at least 1")

    import jax
    import jax.numpy as jnp
    from jax.experimental.serialize_executable import deserialize_and_load, serialize
    from jax.sharding import SingleDeviceSharding

    from tpu_train.device import runtime

    runtime.platform()  # the platform TPU_TRAIN_PLATFORM names, or the best one present
    device = jax.devices()[0]
    times: dict[str, list] = {}

    def timed(stage, call):
        start = time.perf_counter()
        result = call()
        times.setdefault(stage, []).append(1000 * (time.perf_counter() - start))
        return result

    compile_only = None
    if device.platform == "tpu":
        from jax.experimental import topologies

        compile_only = topologies.get_topology_desc(
            "v5e:1x1", "tpu", chips_per_host_bounds=(1, 1, 1), num_slices=1).devices[0]
    size_kb = None
    for i in range(args.shapes):
        x = jnp.ones((3 + i, 5), jnp.float32)
        lowered = timed("lower", lambda: jax.jit(jnp.sin).lower(x))
        compiled = timed("compile", lowered.compile)
        timed("first_run", lambda: compiled(x).block_until_ready())
        timed("second_run", lambda: compiled(x).block_until_ready())
        payload, in_tree, out_tree = timed("serialize", lambda: serialize(compiled))
        size_kb = len(payload) / 1e3
        timed("deserialize_and_load", lambda: deserialize_and_load(payload, in_tree, out_tree))
        if compile_only is not None:
            spec = jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=SingleDeviceSharding(compile_only))
            target = jax.jit(jnp.tanh).trace(spec).lower()
            timed("compile_only_v5e", target.compile)
    report = {"benchmark": "compile_floor", "platform": device.platform,
              "device_kind": device.device_kind, "shapes": args.shapes,
              "executable_kb": round(size_kb, 1)}
    report["ms_median_fastest"] = {stage: [round(statistics.median(v), 2), round(min(v), 2)]
                                   for stage, v in times.items()}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
