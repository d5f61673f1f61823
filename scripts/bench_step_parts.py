#!/usr/bin/env python
"""Where the host's time goes in each W1 step, the trainer's compiled step against the JAX
reference, interleaved, with variants that move the step's one wait.

Every step is timed from the call until its loss is on the host, as
``bench_train_step.py --size w1`` times it, and the trainer's step is cut into parts by the
host's clock (``time.perf_counter``):

* ``pre``: from the call to the program's dispatch (the last call's step counts settled, the
  batch into torch tensors, the call plan, the signature, the host scalars);
* ``dispatch``: JAX's own call of the compiled program (its host arguments' transfer, the
  launch);
* ``post``: from the dispatch's return to the call's return (the write-back, the scheduler,
  the result tensors), while the program runs; in a variant that waits in the call, to the
  wait;
* ``wait``, ``after``: in such a variant, the finiteness flag's read and the rest of the call;
* ``loss_read``: ``float(loss)`` after the call: the step's one wait for the device.

The JAX reference has ``call`` (two ``device_put`` and the jitted call) and ``loss_read``.
Variants of the trainer's step, each changing one thing around the same program:
``compiled`` (as the trainer runs it), ``compiled_flag_read_in_call`` (the call reads its
finiteness flag and settles the step counts before returning, as the step did before it left
that to the next call: two reads a step, the flag's and the loss's) and
``compiled_batch_put_first`` (the batch's host tensors are put on the device first thing in the
call, with ``jax.device_put``, instead of going to the program as NumPy arrays that its call
transfers: the program's first op needs the tokens, and a transfer started before the call's
other host work may have arrived by the launch; a program of its own, compiled in the
variant's first round, which the left-out rounds cover).

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
PARTS = ("step", "call", "pre", "dispatch", "post", "wait", "after", "loss_read")


class Marks:
    """Timestamps of one step: the program's dispatch (A, B) and the flag's read (C, D)."""

    def __init__(self):
        self.at: dict[str, float] = {}

    def timed(self, start: str, end: str, fn):
        def wrapper(*args):
            self.at[start] = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.at[end] = time.perf_counter()
        wrapper.timed = True
        return wrapper


def trainer_variants(step_module, marks: Marks) -> dict:
    """name -> (``_finish``, ``__call__``, ``_prepared``, ``_batch_arrays``) of the trainer's
    step for each variant."""
    import jax
    import torch

    from tpu_train.device import runtime
    from tpu_train.device.tensor import host_array

    cls = step_module.CompiledTrainStep
    finish, call, prepared, batch_arrays = (cls._finish, cls.__call__, cls._prepared,
                                            cls._batch_arrays)
    put_first: dict = {}

    def prepared_putting_the_batch_first(self, batch):
        device = runtime.jax_device(0)
        put_first.clear()
        put_first.update({id(t): jax.device_put(host_array(t), device)
                          for t in batch.values()
                          if isinstance(t, torch.Tensor) and t.device.type == "cpu"})
        out = prepared(self, batch)
        entry = self.cache.entries.get(out[3])
        if entry is not None and not getattr(entry.executable, "timed", False):
            entry.executable = marks.timed("A", "B", entry.executable)
        return out

    def batch_arrays_put_first(self, names, leaves):
        arrays = batch_arrays(self, names, leaves)
        return [put_first.get(id(t), a) for t, a in zip(leaves, arrays)]

    def finish_reading_the_flag(self, plan, entry, steps, outputs):
        out = finish(self, plan, entry, steps, outputs)
        marks.at["C"] = time.perf_counter()
        self.settle()
        marks.at["D"] = time.perf_counter()
        return out

    return {"compiled": (finish, call, prepared, batch_arrays),
            "compiled_flag_read_in_call": (finish_reading_the_flag, call, prepared,
                                           batch_arrays),
            "compiled_batch_put_first": (finish, call, prepared_putting_the_batch_first,
                                         batch_arrays_put_first)}


def parts_of(at: dict, t0: float, returned: float, read: float) -> dict:
    parts = {"step": read - t0, "call": returned - t0, "loss_read": read - returned}
    if "A" in at:
        parts.update(pre=at["A"] - t0, dispatch=at["B"] - at["A"])
        if "C" in at:
            parts.update(post=at["C"] - at["B"], wait=at["D"] - at["C"],
                         after=returned - at["D"])
        else:
            parts["post"] = returned - at["B"]
    return parts


def run(steps: int) -> dict:
    import train_step_modes as tsm

    from tpu_train.compile import train_step as step_module

    ours, reference, batches = tsm.w1_pair(steps)
    ours.block(ours.step(batches[0]))  # compiles
    reference.block(reference.step(batches[0]))
    marks = Marks()
    entry = ours.train_step.compiled.cache.last_entry
    entry.executable = marks.timed("A", "B", entry.executable)
    cls = step_module.CompiledTrainStep
    originals = (cls._finish, cls.__call__, cls._prepared, cls._batch_arrays)
    variants = {**trainer_variants(step_module, marks), "jax": None}
    names = list(variants)
    recorded = {name: {part: [] for part in PARTS} for name in names}
    for i in range(steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            mode = reference if variants[name] is None else ours
            if variants[name] is not None:
                cls._finish, cls.__call__, cls._prepared, cls._batch_arrays = variants[name]
            marks.at.clear()
            try:
                t0 = time.perf_counter()
                loss = mode.step(batches[i])
                returned = time.perf_counter()
                mode.block(loss)
                read = time.perf_counter()
            finally:
                cls._finish, cls.__call__, cls._prepared, cls._batch_arrays = originals
            if i >= WARMUP:
                for part, seconds in parts_of(marks.at, t0, returned, read).items():
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
