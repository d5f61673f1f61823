"""What moving host tensors to the ``tpu`` device costs: ``tensor.to("tpu")`` of a batch and
``module.to("tpu")`` of a model, against ``jax.device_put`` of the same NumPy arrays.

Exact command (from the repository root)::

    python scripts/bench_host_to_device.py        # --repeats 15 --batches 50 --size w1

torch makes the destination with ``torch.empty`` on the device and copies into it. Three modes,
interleaved ``--repeats`` times in one process:

* ``to``: ``.to("tpu")`` as it is (an ``empty`` is filled only if something reads it);
* ``to_filled_empty``: the same with every ``empty`` filled when made, as before
  ``Storage.unfilled`` (a fill program per tensor, or on a TPU a host copy of zeros for a
  size's first fill);
* ``device_put``: ``jax.device_put`` of the NumPy arrays, the floor.

Each mode moves ``--batches`` batches of two [4, 256] int64 tensors (a W1 batch), then places
a fresh copy of the ``--size`` Llama (``scripts/jax_llama.py`` SIZES) on the device, waiting
for every buffer. Prints ONE JSON line: per mode the min and median microseconds per batch
and milliseconds per model, and the ratios to ``to``. Runs on the best platform present (a
TPU, else the CPU; ``TPU_TRAIN_PLATFORM`` chooses) and says which.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time

import jax
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax_llama  # noqa: E402
import provenance  # noqa: E402
from train_step_modes import device_facts  # noqa: E402

import tpu_train  # noqa: E402,F401  (registers the tpu device)
from tpu_train.device import storage as storage_mod  # noqa: E402
from tpu_train.device import storage_of  # noqa: E402
from tpu_train.models import Llama  # noqa: E402

MODES = ("to", "to_filled_empty", "device_put")


@contextlib.contextmanager
def filled_empty():
    """``torch.empty`` on the device filled when made (the behaviour before fill-on-read)."""
    unfilled = storage_mod.Storage.unfilled

    def filled_now(numel, dtype, device_index):
        return storage_mod.Storage(storage_mod.allocate(numel, dtype, device_index, 0), dtype,
                                   device_index)

    storage_mod.Storage.unfilled = staticmethod(filled_now)
    try:
        yield
    finally:
        storage_mod.Storage.unfilled = unfilled


def _wait(tensors) -> None:
    jax.block_until_ready([storage_of(t).as_stored() for t in tensors])


def move_batches(mode: str, batches: list[dict]) -> float:
    device = jax.devices()[0] if mode == "device_put" else None
    start = time.perf_counter()
    if mode == "device_put":
        jax.block_until_ready([jax.device_put(v.numpy(), device)
                               for b in batches for v in b.values()])
    else:
        with filled_empty() if mode == "to_filled_empty" else contextlib.nullcontext():
            moved = [v.to("tpu") for b in batches for v in b.values()]
        _wait(moved)
    return time.perf_counter() - start


def place_model(mode: str, model: torch.nn.Module) -> float:
    if mode == "device_put":
        arrays = [p.detach().numpy() for p in model.parameters()]
        start = time.perf_counter()
        jax.block_until_ready([jax.device_put(a, jax.devices()[0]) for a in arrays])
        return time.perf_counter() - start
    fresh = copy.deepcopy(model)
    start = time.perf_counter()
    with filled_empty() if mode == "to_filled_empty" else contextlib.nullcontext():
        fresh.to("tpu")
    _wait(list(fresh.parameters()))
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--size", choices=tuple(jax_llama.SIZES), default="w1")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    batches = [{k: torch.from_numpy(rng.integers(0, 8192, (4, 256))) for k in ("tokens", "labels")}
               for _ in range(args.batches)]
    torch.manual_seed(0)
    model = Llama(jax_llama.SIZES[args.size].config())
    per_batch = {m: [] for m in MODES}
    per_model = {m: [] for m in MODES}
    for mode in MODES:  # warm-up: every program compiled, every size filled once
        move_batches(mode, batches[:2])
        place_model(mode, model)
    for _ in range(args.repeats):
        for mode in MODES:
            per_batch[mode].append(move_batches(mode, batches) / args.batches)
            per_model[mode].append(place_model(mode, model))

    def figures(samples, scale):
        return [round(min(samples) * scale, 1), round(statistics.median(samples) * scale, 1)]

    report = {"benchmark": "bench_host_to_device", **device_facts(), "commit": provenance.commit(),
              "batches": args.batches, "repeats": args.repeats, "size": args.size,
              "batch_us": {m: figures(per_batch[m], 1e6) for m in MODES},
              "model_ms": {m: figures(per_model[m], 1e3) for m in MODES}}
    for unit, samples in (("batch", per_batch), ("model", per_model)):
        base = statistics.median(samples["to"])
        report[f"{unit}_median_over_to"] = {m: round(statistics.median(samples[m]) / base, 3)
                                            for m in MODES if m != "to"}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
