#!/usr/bin/env python
"""Where the host's time goes in each W1 step, the trainer's compiled step against the JAX
reference, interleaved, with variants that move the step's one wait.

Every step is timed from the call until its loss is on the host, as
``bench_train_step.py --size w1`` times it, and the trainer's step is cut into parts by the
host's clock (``time.perf_counter``):

* ``pre``: from the call to the program's dispatch (the batch into torch tensors, the call
  plan, the signature, the host scalars);
* ``dispatch``: JAX's own call of the compiled program (its host arguments' transfer, the
  launch);
* ``post``: from the dispatch's return to the read of the finiteness flag (the write-back, the
  scheduler, the result tensors), while the program runs;
* ``wait``: the flag's read, the call's one wait for the device;
* ``after``: from the flag's arrival to the call's return;
* ``loss_read``: ``float(loss)`` after the call.

The JAX reference has ``call`` (two ``device_put`` and the jitted call) and ``loss_read``.
Variants of the trainer's step, each changing one thing around the same program:
``compiled`` (as the trainer runs it), ``compiled_args_held`` (the program's argument lists
kept alive until the call returns, as before the launch got a frame of its own: releasing the
donated inputs then comes after the wait), ``compiled_read_first`` (the flag read right after
the dispatch, before the rest of the call's host work) and ``compiled_no_flag_read`` (the call
does not read its flag; the loss read after it is the step's one wait, as the reference's is).

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
        return wrapper


def trainer_variants(step_module, marks: Marks) -> dict:
    """name -> (flag read, ``_finish``, ``__call__``, ``_prepared``) of the trainer's step for
    each variant."""
    cls = step_module.CompiledTrainStep
    read, finish, call, prepared = (step_module.read_finite, cls._finish, cls.__call__,
                                    cls._prepared)
    timed_read = marks.timed("C", "D", read)
    held = []

    def holding_prepared(self, batch):  # its result holds the argument lists
        held.append(prepared(self, batch))
        return held[-1]

    def call_args_held(self, batch):
        out = call(self, batch)
        held.clear()
        return out

    def finish_read_first(self, plan, entry, steps, outputs):
        timed_read(outputs[3])
        return finish(self, plan, entry, steps, outputs)

    return {"compiled": (timed_read, finish, call, prepared),
            "compiled_args_held": (timed_read, finish, call_args_held, holding_prepared),
            "compiled_read_first": (read, finish_read_first, call, prepared),
            "compiled_no_flag_read": (lambda metrics: True, finish, call, prepared)}


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
    originals = (step_module.read_finite, cls._finish, cls.__call__, cls._prepared)
    variants = {**trainer_variants(step_module, marks), "jax": None}
    names = list(variants)
    recorded = {name: {part: [] for part in PARTS} for name in names}
    for i in range(steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            mode = reference if variants[name] is None else ours
            if variants[name] is not None:
                (step_module.read_finite, cls._finish, cls.__call__,
                 cls._prepared) = variants[name]
            marks.at.clear()
            try:
                t0 = time.perf_counter()
                loss = mode.step(batches[i])
                returned = time.perf_counter()
                mode.block(loss)
                read = time.perf_counter()
            finally:
                step_module.read_finite, cls._finish, cls.__call__, cls._prepared = originals
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
