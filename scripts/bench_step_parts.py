#!/usr/bin/env python
"""Where the host's time goes in each W1 step, the trainer's compiled step against the JAX
reference, interleaved, each with its batch put on the device ahead or at the call.

Every step is timed from the call until its loss is on the host, as
``bench_train_step.py --size w1`` times it, and the trainer's step is cut into parts by the
host's clock (``time.perf_counter``):

* ``pre``: from the call to the program's dispatch (the last call's step counts settled, the
  call plan, the signature, the host scalars);
* ``dispatch``: JAX's own call of the compiled program (the transfer of its host arguments,
  the launch);
* ``post``: from the dispatch's return to the call's return (the write-back, the scheduler,
  the next call's host scalars put on the device, the result tensors), while the program runs;
* ``put_next``: the next batch placed as the trainer's loop places it, once the step is
  dispatched (``TrainStep.put_batch``);
* ``loss_read``: ``float(loss)`` after that: the step's one wait for the device.

The JAX reference has ``call`` (its ``device_put`` of the batch, where not put ahead, and the
jitted call), ``put_next`` and ``loss_read``. Variants: ``compiled`` (the loop's path: the batch
put during the step before), ``compiled_batch_at_call`` (the batch's host tensors given to the
call, which the executable transfers at the launch: a program of its own),
``compiled_scalars_from_host`` (the batch ahead, the host scalars given to the call as a NumPy
array, as before they were put ahead), ``compiled_no_early_copy`` (the batch and scalars ahead,
the metrics' ``copy_to_host_async`` at the dispatch a no-op: the loss read starts the copy),
``jax`` (the reference puts its batch at its call) and ``jax_ahead`` (the reference's batch put
during its step before, as the loop puts the trainer's).

Prints ONE JSON line: per variant and part ``[min, median]`` in ms (the first 10 rounds left
out), and each variant's median step over JAX's. Usage::

    python scripts/bench_step_parts.py [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WARMUP = 10
PARTS = ("step", "call", "pre", "dispatch", "post", "put_next", "loss_read")


class Marks:
    """Timestamps of one step: the program's dispatch (A, B)."""

    def __init__(self):
        self.at: dict[str, float] = {}

    def timed(self, start: str, end: str, fn):
        def wrapper(*args):
            self.at[start] = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.at[end] = time.perf_counter()
        return wrapper


def parts_of(at: dict, t0: float, returned: float, put: float, read: float) -> dict:
    parts = {"step": read - t0, "call": returned - t0, "put_next": put - returned,
             "loss_read": read - put}
    if "A" in at:
        parts.update(pre=at["A"] - t0, dispatch=at["B"] - at["A"], post=returned - at["B"])
    return parts


class Patched:
    """A variant's changes around the same program: attributes set for its step only."""

    def __init__(self, *changes):
        self.changes = changes  # (owner, attribute name, value during the step)
        self.saved = []

    def __enter__(self):
        self.saved = [(owner, name, getattr(owner, name)) for owner, name, _ in self.changes]
        for owner, name, value in self.changes:
            setattr(owner, name, value)

    def __exit__(self, *exc):
        for owner, name, value in self.saved:
            setattr(owner, name, value)


def run(steps: int) -> dict:
    import jax
    import numpy as np
    import train_step_modes as tsm

    from tpu_train.compile.lowering import ScalarsAhead

    ours, reference, batches = tsm.w1_pair(steps)
    take = ScalarsAhead.take
    array_type = type(jax.device_put(np.float32(0)))  # jax.Array's concrete class
    variants = {
        "compiled": (ours, True, Patched()),
        "compiled_batch_at_call": (ours, False, Patched()),
        # The scalars put ahead are taken (and dropped), the host's array goes in.
        "compiled_scalars_from_host": (ours, True, Patched(
            (ScalarsAhead, "take", lambda self, values: (take(self, values), values)[1]))),
        "compiled_no_early_copy": (ours, True, Patched((array_type, "copy_to_host_async",
                                                        lambda self: None))),
        "jax": (reference, False, Patched()),
        "jax_ahead": (reference, True, Patched())}
    for mode, ahead, patched in variants.values():  # compiles each program
        mode.batches_ahead = ahead
        with patched:
            mode.block(mode.step(batches[0]))
    marks = Marks()
    for entry in ours.train_step.compiled.cache.entries.values():
        entry.executable = marks.timed("A", "B", entry.executable)
    names = list(variants)
    recorded = {name: {part: [] for part in PARTS} for name in names}
    for i in range(steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            mode, mode.batches_ahead, patched = variants[name]
            marks.at.clear()
            with patched:
                t0 = time.perf_counter()
                loss = mode.step(batches[i])
                returned = time.perf_counter()
                if i + 1 < steps:
                    mode.put_ahead(batches[i + 1])
                put = time.perf_counter()
                mode.block(loss)
                read = time.perf_counter()
            if i >= WARMUP:
                for part, seconds in parts_of(marks.at, t0, returned, put, read).items():
                    recorded[name][part].append(seconds)
    report = {name: {part: [round(min(v) * 1e3, 3), round(statistics.median(v) * 1e3, 3)]
                     for part, v in parts.items() if v}
              for name, parts in recorded.items()}
    jax_median = statistics.median(recorded["jax"]["step"])
    report["median_over_jax"] = {name: round(statistics.median(recorded[name]["step"])
                                             / jax_median, 3) for name in names}
    return report


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="rounds of every variant")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        parser.error(f"--steps must be more than the {WARMUP} rounds left out")
    import train_step_modes as tsm

    import tpu_train  # noqa: F401  (the platform TPU_TRAIN_PLATFORM names)

    report = {**tsm.device_facts(), "date": time.strftime("%Y-%m-%d"), "steps": args.steps,
              "w1": run(args.steps)}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
