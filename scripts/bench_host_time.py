#!/usr/bin/env python
"""Host time of one training step: the trainer's compiled step call, its parts, and the
``fit`` loop around it, for a ~150-tensor Llama (W1's width, 16 layers: 147 tensors).

What is timed, with the host's own clock (``time.perf_counter``), min and median over many
calls; before each timed call the previous step has finished on the device, so a call's time
is what the host spends on it (plus, where the call itself waits for the device, that wait,
reported on its own):

* ``step_call``: ``TrainStep.__call__`` exactly as ``tpu-train trainer.mode=compiled`` builds
  it (``scripts/train_step_modes.py``: skipping non-finite updates, AdamW on the trainer's two
  parameter groups, clipping, bf16 compute). Split into ``program_dispatch`` (inside the
  compiled program's call: JAX's own host work to launch it), ``finite_wait`` (the read of the
  last step's finiteness flag when the next call settles the step counts: that step's metrics,
  read by the loop, are on the host by then) and ``host`` (everything else: the project's own
  work);
* ``host_only``: the same call with the compiled program replaced by a stub that returns its
  inputs at once, so the device is out of the picture: the project's host work alone, and its
  parts (``inputs_check``: is the cached call plan still valid; ``signature``: the compile
  signature; ``step_counts``: the optimizer's counters and the per-group host scalars;
  ``finish``: writing the results back, the scheduler's step, the result tensors);
* ``jax_reference_call``: one step of the hand-written JAX reference of the same model
  (``scripts/jax_llama.py``: two ``device_put`` and one jitted call with donated pytrees):
  what a JAX user's step costs the host, the floor to compare ``step_call`` with;
* ``noop``: the trainer's step and the JAX reference's step, each with its compiled program
  replaced by a no-op program of the same arguments and results (donations included), the
  two interleaved, each step timed until its loss is read on the host
  (``train_step_modes.wait_for_loss``, as ``bench_train_step.py --size`` times a step): what
  one step costs the host around a device that has nothing to do, JAX's own jitted call of the
  same pytree being the yardstick (``compiled_over_jax``). On a chip every microsecond of it
  outside the program's run adds to a step that the host waits for. The trainer's side is
  split into ``program_dispatch``, ``finite_wait`` (here: only the flag's transfer),
  ``loss_read`` and ``host`` (the rest); the reference's into ``call`` (two ``device_put``
  and the jitted call) and ``loss_read``. Its ``transfers`` part prices the transfers a
  step makes (:func:`time_transfers`);
* ``loop`` (``--loop-steps``, 0 to skip): ``tpu_train.trainer.loop.fit`` on the bundled data
  with the program stubbed as above after its first (compiling) step: ``per_step`` (start of
  one step call to the next), and of it ``step_call``, ``data`` (the loader's next batch) and
  ``logging`` (metrics.jsonl, TensorBoard, log lines); ``other`` is the rest (reading the
  loss, gradient norm and flag, the loop's own checks).

Prints ONE JSON line. Usage (``--dim``/``--heads``/``--seq`` make it cheap to compile on a
CPU; on a chip the defaults)::

    python scripts/bench_host_time.py [--layers 16] [--calls 400] [--loop-steps 200]
    python scripts/bench_host_time.py --dim 64 --heads 2 --kv-heads 1 --seq 32   # a CPU
    python scripts/bench_host_time.py --layers 4 --noop-only   # W1: the step's host cost vs JAX's
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

# The sibling modules (jax_llama, train_step_modes), and this checkout's tpu_train before any
# installed one.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]


def figures(seconds: list) -> dict:
    """Min and median in milliseconds."""
    if not seconds:
        return {"min": None, "median": None}
    return {"min": round(min(seconds) * 1e3, 4), "median": round(statistics.median(seconds) * 1e3, 4)}


class Timings:
    """Seconds per label, per call: ``with timings("label")`` adds to the current call."""

    def __init__(self):
        self.current: dict = collections.defaultdict(float)
        self.calls: dict = collections.defaultdict(list)
        self.recording = False

    @contextlib.contextmanager
    def __call__(self, label: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.current[label] += time.perf_counter() - start

    def next_call(self, labels) -> None:
        if self.recording:
            for label in labels:
                self.calls[label].append(self.current.get(label, 0.0))
        self.current.clear()

    def wrap(self, obj, name: str, label: str):
        """Time every call of ``obj.name`` under ``label`` (an instance or class attribute);
        returns what undoes it."""
        function = getattr(obj, name)
        had_own = name in vars(obj)

        def timed(*args, **kwargs):
            with self(label):
                return function(*args, **kwargs)

        setattr(obj, name, timed)
        return lambda: setattr(obj, name, function) if had_own else delattr(obj, name)


def time_finite_reads(timings: Timings) -> None:
    """Time the reads of the steps' finiteness flags (``finite_wait``): each call settles the
    last one's step counts with it."""
    from tpu_train.compile import train_step

    read = getattr(train_step.read_finite, "untimed", train_step.read_finite)

    def timed(metrics) -> bool:
        with timings("finite_wait"):
            return read(metrics)

    timed.untimed = read
    train_step.read_finite = timed


class TimedProgram:
    """The compiled program, its call timed (``program_dispatch``); or, with ``stub``, not
    called at all: its inputs come back as the new values, with fixed metrics."""

    def __init__(self, program, timings: Timings, stub: bool, returns_flag: bool):
        import jax.numpy as jnp

        self.program, self.timings, self.stub = program, timings, stub
        # loss, gradient norm, lr (and the finiteness flag): tpu_train.compile.program.METRICS
        self.metrics = jnp.ones((4 if returns_flag else 3,), jnp.float32)
        time_finite_reads(timings)

    def __call__(self, params, states, consts, batch, scalars, layer_indices, *key):
        if self.stub:
            return params, states, [], self.metrics
        with self.timings("program_dispatch"):
            return self.program(params, states, consts, batch, scalars, layer_indices, *key)


def install_program(compiled, timings: Timings, stub: bool) -> None:
    """Put a :class:`TimedProgram` in front of the latest compiled program of ``compiled``."""
    entry = compiled.cache.last_entry
    program = entry.executable
    if isinstance(program, TimedProgram):
        program = program.program
    entry.executable = TimedProgram(program, timings, stub, compiled.skip_non_finite)


def config(args):
    """The trainer's config for ``tpu-train model=llama_<size>`` at ``--precision`` (the size's
    own trainer settings, as a user's run gets them; the model itself is replaced)."""
    import train_step_modes as tsm

    return tsm.trainer_config(args.precision, tsm.model_option(args.size))


def size_of(args):
    import jax_llama

    base = jax_llama.SIZES[args.size]
    dim = args.dim or base.dim
    heads = args.heads or base.n_heads
    return dataclasses.replace(
        base, name=f"{args.size}-host", dim=dim, n_layers=args.layers, n_heads=heads,
        n_kv_heads=args.kv_heads or max(1, heads // 2),
        ffn_hidden_dim=base.ffn_hidden_dim if dim == base.dim else int(dim * 2.75),
        seq=args.seq or base.seq, batch=args.batch or base.batch)


def time_step_calls(size, args, timings: Timings) -> dict:
    """``step_call`` and ``host_only`` (module docstring) on the trainer's compiled step."""
    import jax
    import numpy as np
    import torch
    import train_step_modes as tsm

    from bench_train_step import make_batches
    from tpu_train.compile import call_plan, train_step
    from tpu_train.device.tensor import storage_of
    from tpu_train.models import Llama

    cpu_model = Llama(size.config())
    cpu_model.init_weights(seed=0, device="cpu")
    mode = tsm.TrainerMode(cpu_model, config(args))
    compiled = mode.train_step.compiled
    batches = [{k: torch.from_numpy(np.asarray(v, dtype=np.int64)) for k, v in b.items()}
               for b in make_batches(16, size.vocab_size, batch=size.batch, seq=size.seq)]
    mode.block(mode.train_step(batches[0])["loss"])  # compiles
    parameters = list(compiled.model.parameters())
    # (What an older tpu_train lacks is left out, so that the script measures it too.)
    undo = [timings.wrap(obj, name, label)
            for obj, name, label in ((call_plan.CallPlan, "holds", "inputs_check"),
                                     (call_plan.CallPlan, "signature", "signature"),
                                     (train_step, "host_scalars", "step_counts"),
                                     (compiled, "_finish", "finish")) if hasattr(obj, name)]
    report = {"tensors": len(list(compiled.model.parameters())) + len(list(compiled.model.buffers()))}
    for stub, key in ((False, "step_call"), (True, "host_only")):
        install_program(compiled, timings, stub)
        timings.calls.clear()
        for i in range(args.warmup + args.calls):
            timings.recording = i >= args.warmup
            with timings("call"):
                out = mode.train_step(batches[i % len(batches)])
            jax.block_until_ready([storage_of(out["loss"])._resolved()]
                                  + [storage_of(p)._resolved() for p in parameters])
            timings.next_call(("call", "program_dispatch", "finite_wait", "inputs_check",
                               "signature", "step_counts", "finish"))
        calls = timings.calls
        if stub:
            report[key] = {"call": figures(calls["call"]),
                           **{part: figures(calls[part]) for part in
                              ("inputs_check", "signature", "step_counts", "finish")}}
        else:
            host = [c - d - w for c, d, w in zip(calls["call"], calls["program_dispatch"],
                                                 calls["finite_wait"])]
            report[key] = {"call": figures(calls["call"]),
                           "program_dispatch": figures(calls["program_dispatch"]),
                           "finite_wait": figures(calls["finite_wait"]),
                           "host": figures(host)}
    for restore in undo:
        restore()
    report["compilations"] = len(compiled.compilations)
    return report


def time_reference(size, args) -> dict:
    """``jax_reference_call``: the hand-written JAX step's call, blocked before each."""
    import train_step_modes as tsm

    from bench_train_step import make_batches
    from tpu_train.models import Llama

    cpu_model = Llama(size.config())
    cpu_model.init_weights(seed=0, device="cpu")
    reference = tsm.ReferenceMode(cpu_model, size, tsm.hyper_from(config(args)), args.precision)
    batches = make_batches(16, size.vocab_size, batch=size.batch, seq=size.seq)
    reference.block(reference.step(batches[0]))
    seconds = []
    for i in range(args.warmup + args.calls):
        start = time.perf_counter()
        loss = reference.step(batches[i % len(batches)])
        if i >= args.warmup:
            seconds.append(time.perf_counter() - start)
        reference.block(loss)
    return figures(seconds)


def time_noop(size, args) -> dict:
    """``noop`` (module docstring)."""
    import jax
    import jax.numpy as jnp
    import train_step_modes as tsm

    from bench_train_step import make_batches
    from tpu_train.models import Llama

    cpu_model = Llama(size.config())
    cpu_model.init_weights(seed=0, device="cpu")
    ours = tsm.TrainerMode(cpu_model, config(args))
    reference = tsm.ReferenceMode(cpu_model, size, tsm.hyper_from(config(args)), args.precision)
    batches = make_batches(16, size.vocab_size, batch=size.batch, seq=size.seq)
    ours.block(ours.step(batches[0]))  # compiles both real programs
    reference.block(reference.step(batches[0]))
    compiled, ref = ours.train_step.compiled, reference.reference
    entry = compiled.cache.last_entry
    program, seen = entry.executable, {}

    def capture(*arguments):
        seen["arguments"] = arguments
        seen["outputs"] = program(*arguments)
        return seen["outputs"]

    entry.executable = capture
    ours.block(ours.step(batches[1]))
    arguments, outputs = seen["arguments"], seen["outputs"]
    # Parameters and state pass through (donated, as in the step); the mutated constants and
    # the metrics come from the batch, so that the program reads its inputs.
    noop = jax.jit(
        lambda params, states, consts, batch, scalars, *rest: (
            params, states,
            [c + jnp.zeros((), c.dtype) for c in [consts[p] for p in entry.mutated_consts]],
            *[jnp.full(o.shape, sum(jnp.sum(b).astype(jnp.float32) for b in batch), o.dtype)
              for o in outputs[3:]]),
        donate_argnums=(0, 1))
    timings = Timings()
    entry.executable = TimedProgram(noop.lower(*jax.tree.map(_spec, arguments)).compile(),
                                    timings, stub=False, returns_flag=compiled.skip_non_finite)
    tokens = ref._put(batches[0]["tokens"])
    ref.compiled = jax.jit(
        lambda params, state, tokens, labels, cos, sin: (
            params, state, *(jnp.sum(tokens).astype(jnp.float32),) * 2),
        donate_argnums=(0, 1)).lower(ref.params, ref.opt_state, tokens, tokens, ref.cos,
                                     ref.sin).compile()
    steps = {"compiled_step": [], "jax_reference": []}
    reference_parts = {"call": [], "loss_read": []}
    for i in range(args.warmup + args.calls):
        timings.recording = i >= args.warmup
        batch = batches[i % len(batches)]
        for name in (("compiled_step", "jax_reference") if i % 2 else
                     ("jax_reference", "compiled_step")):
            mode = ours if name == "compiled_step" else reference
            start = time.perf_counter()
            loss = mode.step(batch)
            called = time.perf_counter()
            mode.block(loss)
            end = time.perf_counter()
            if name == "compiled_step":
                timings.current["call"] = called - start
                timings.current["loss_read"] = end - called
                timings.next_call(("call", "program_dispatch", "finite_wait", "loss_read"))
            elif i >= args.warmup:
                reference_parts["call"].append(called - start)
                reference_parts["loss_read"].append(end - called)
            if i >= args.warmup:
                steps[name].append(end - start)
    transfers = time_transfers(ref, batches, args)
    calls = timings.calls
    host = [c - d - w for c, d, w in zip(calls["call"], calls["program_dispatch"],
                                         calls["finite_wait"])]
    ours_median = statistics.median(steps["compiled_step"])
    jax_median = statistics.median(steps["jax_reference"])
    return {"compiled_step": {"step": figures(steps["compiled_step"]),
                              "program_dispatch": figures(calls["program_dispatch"]),
                              "finite_wait": figures(calls["finite_wait"]),
                              "loss_read": figures(calls["loss_read"]),
                              "host": figures(host)},
            "jax_reference": {"step": figures(steps["jax_reference"]),
                              **{part: figures(v) for part, v in reference_parts.items()}},
            "compiled_over_jax": {
                "min": round(min(steps["compiled_step"]) / min(steps["jax_reference"]), 3),
                "median": round(ours_median / jax_median, 3)},
            "transfers": transfers}


def time_transfers(ref, batches: list, args) -> dict:
    """``transfers``: one no-op program over the reference's parameters and optimizer state
    (donated) plus tokens, labels and a host-scalar array, returning a loss, a gradient norm,
    an lr and a finiteness flag, called four ways, interleaved (per step, min / median ms):

    * ``put_ready``: three ``device_put``, the call, ``block_until_ready`` of the loss;
    * ``put_read``: the same, the loss read on the host instead (one transfer back);
    * ``host_args_read``: the three host arrays passed to the call itself (as the trainer's
      step passes them), the loss read;
    * ``host_args_four_reads``: the same, the four results' transfers asked for at once
      (flag first) and the flag then the loss read: the trainer's step's transfers.

    The differences price one transfer back, host arrays in the call against ``device_put``,
    and three more transfers back, on this platform."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def noop(params, state, tokens, labels, scalars):
        seed = (jnp.sum(tokens) + jnp.sum(labels)).astype(jnp.float32) + scalars[0, 0]
        one = jnp.full((1,), seed, jnp.float32)
        return params, state, one, one + 1, scalars[0, :1], seed > 0

    device = ref.device
    host = [dict(tokens=np.asarray(b["tokens"], np.int32), labels=np.asarray(b["labels"], np.int32),
                 scalars=np.full((2, 4), 0.5, np.float32)) for b in batches]
    first = host[0]
    program = jax.jit(noop, donate_argnums=(0, 1)).lower(
        ref.params, ref.opt_state, first["tokens"], first["labels"], first["scalars"]).compile()
    state = {"params": ref.params, "opt": ref.opt_state}

    def run(arrays, put: bool, reads: str):
        if put:
            arrays = {k: jax.device_put(v, device) for k, v in arrays.items()}
        state["params"], state["opt"], loss, norm, lr, flag = program(
            state["params"], state["opt"], arrays["tokens"], arrays["labels"], arrays["scalars"])
        if reads == "ready":
            jax.block_until_ready(loss)
        elif reads == "loss":
            float(np.asarray(loss)[0])  # no indexing program
        else:
            for value in (flag, loss, norm, lr):
                value.copy_to_host_async()
            bool(flag)
            float(np.asarray(loss)[0])  # no indexing program

    ways = {"put_ready": (True, "ready"), "put_read": (True, "loss"),
            "host_args_read": (False, "loss"), "host_args_four_reads": (False, "four")}
    seconds = {name: [] for name in ways}
    names = list(ways)
    for i in range(args.warmup + args.calls):
        rotated = names[i % len(names):] + names[:i % len(names)]
        for name in rotated:
            start = time.perf_counter()
            run(host[i % len(host)], *ways[name])
            if i >= args.warmup:
                seconds[name].append(time.perf_counter() - start)
    ref.params, ref.opt_state = state["params"], state["opt"]
    return {name: figures(values) for name, values in seconds.items()}


def _spec(x):
    import jax
    import numpy as np

    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))


def time_loop(size, args, timings: Timings) -> dict:
    """``loop`` (module docstring): ``fit`` on the bundled data, the program stubbed after the
    first step."""
    from tpu_train.models import CONFIGS
    from tpu_train.trainer import loop, metrics, run as run_mod, setup

    name = f"bench_host_time_{size.dim}x{size.n_layers}"
    CONFIGS[name] = dataclasses.replace(size.config(), max_seq_len=size.seq)
    run_dir = tempfile.mkdtemp(prefix="bench_host_time_run_")
    try:
        cfg = config(args)
        overrides = {"model.name": name, "trainer.max_steps": args.loop_steps + 1,
                     "trainer.val_every_n_steps": 0, "checkpoint.every_n_steps": 10 ** 6,
                     "checkpoint.export_hf": False, "data.batch_size": size.batch,
                     "data.seq_len": size.seq, "run.dir": run_dir}
        for key, value in overrides.items():
            section, field = key.split(".")
            cfg[section][field] = value
        run = run_mod.resume(run_mod.assemble(setup.start(cfg)))
        step_fn, compiled = run.step_fn, run.step_fn.compiled
        starts = []

        def step(batch, _call=step_fn.__call__):
            if len(starts) == 1:  # the first call compiled the program
                install_program(compiled, timings, stub=True)
            starts.append(time.perf_counter())
            # What the last period held: that step's call and logging, this step's batch.
            timings.next_call(("step_call", "data", "logging"))
            with timings("step_call"):
                return _call(batch)

        timings.recording = True
        run.step_fn = _Step(step, compiled)
        run.data.train = _TimedIterable(run.data.train, timings)
        undo = [timings.wrap(metrics.RunLogger, method, "logging")
                for method in ("scalars", "line", "advance")]
        try:
            with contextlib.redirect_stdout(open(os.devnull, "w")):
                loop.fit(run)
        finally:
            for restore in undo:
                restore()
        # Period i runs from call i to call i + 1; the record made at call i + 1 holds its
        # parts. The first two periods (compiling, installing the stub) are left out.
        periods = [b - a for a, b in zip(starts, starts[1:])][2:]
        parts = {label: timings.calls[label][1:][2:] for label in ("step_call", "data", "logging")}
        other = [p - sum(parts[label][i] for label in parts) for i, p in enumerate(periods)]
        return {"steps": len(periods), "per_step": figures(periods),
                **{label: figures(values) for label, values in parts.items()},
                "other": figures(other)}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


class _Step:
    """The run's TrainStep, its call timed (``compiled`` is what the loop reads from it)."""

    def __init__(self, call, compiled):
        self._call, self.compiled = call, compiled

    def __call__(self, batch):
        return self._call(batch)


class _TimedIterable:
    def __init__(self, loader, timings: Timings):
        self.loader, self.timings = loader, timings

    def __iter__(self):
        iterator = iter(self.loader)
        while True:
            with self.timings("data"):
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
            yield batch

    def __getattr__(self, name):
        return getattr(self.loader, name)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="w1", choices=("w1", "350m", "1b"),
                        help="the width (and batch) of this jax_llama size (default w1)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, help="model width instead of the size's")
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--loop-steps", type=int, default=200)
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--noop-only", action="store_true",
                        help="only the no-op program comparison (noop)")
    args = parser.parse_args(argv)
    import train_step_modes as tsm

    size = size_of(args)
    timings = Timings()
    report = {"date": time.strftime("%Y-%m-%d"), **tsm.device_facts(),
              "model": {"dim": size.dim, "layers": size.n_layers, "heads": size.n_heads,
                        "kv_heads": size.n_kv_heads, "ffn": size.ffn_hidden_dim,
                        "vocab": size.vocab_size, "batch": size.batch, "seq": size.seq},
              "precision": args.precision, "calls": args.calls}
    if args.noop_only:
        report["noop"] = time_noop(size, args)
        print(json.dumps(report))
        return report
    report.update(time_step_calls(size, args, timings))
    if not args.no_reference:
        report["jax_reference_call"] = time_reference(size, args)
        report["noop"] = time_noop(size, args)
    if args.loop_steps:
        report["loop"] = time_loop(size, args, Timings())
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
