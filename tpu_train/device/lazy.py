"""Eager modes, and the recording behind the fused one.

``strict`` (the default) runs every op of the calling code as its own XLA executable as soon
as it is called; a backward pass's ops and runs of multi-tensor ops (an optimizer's step) are
recorded and run as one program before the next other op (``batch_backward``,
``batch_multi_tensor``).
``fused`` records ops instead of running them: each op's output buffer is a :class:`Pending`
value, the op's cached executable and its inputs are appended to its device's region, and the
region runs as one XLA program when a value is needed. ``debug`` is strict and waits after
every op, so that an error points at the op that caused it (``TPU_TRAIN_SYNC=1`` is the same).

What flushes a region: reading a pending buffer for anything but recording another op (``.item()``,
``.cpu()``, ``print``, a Python ``if`` on a tensor, a collective, a host copy, FSDP2 resizing a
storage), ``torch.tpu.synchronize()``, leaving fused mode, an op that cannot be recorded (one
that needs concrete values, or whose result shapes depend on them) and the region reaching
``TPU_TRAIN_FUSED_MAX_OPS`` ops.

A region's program is keyed by its structure: which cached executables ran in which order,
how their inputs were wired (an earlier op's output, or an input of the region) and which
outputs are still referenced when it runs. A training loop therefore compiles its regions once;
values that change (a learning rate, the batch) are inputs. Outputs nobody references any
more (a forward's intermediates freed by backward) are not outputs of the program at all, and
XLA fuses across op boundaries -- the two things strict mode cannot do.

Aliasing holds as in strict mode: a tensor's storage holds a buffer; an in-place op's recorded
executable reads the destination's current buffer (perhaps pending) and the storage takes the
new pending buffer, so every view reads the write, in order.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import jax
import numpy
import torch

from tpu_train.device import dispatch_thread, runtime, scalars
from tpu_train.device.dispatch_thread import Issued

MODE_ENV = "TPU_TRAIN_EAGER_MODE"
STRICT_RECORD_ENV = "TPU_TRAIN_STRICT_RECORD"
STRICT_RECORDS = ("backward", "all")
MAX_OPS_ENV = "TPU_TRAIN_FUSED_MAX_OPS"
STRICT, FUSED, DEBUG = "strict", "fused", "debug"
MODES = (STRICT, FUSED, DEBUG)

active = False  # fused mode is on: read on every op call
# Strict mode records runs of multi-tensor (``_foreach_*``) ops into its device's region too.
# An optimizer's step is such a run (AdamW: 8 ops, each one program over every parameter; on a
# TPU each program call costs host time per buffer); recorded, it runs as one program, with the
# old parameter and state buffers donated, before the next other op (the dispatcher calls
# flush_all while ``deferred``) or when something reads a result. Debug mode does not.
batch_multi_tensor = True
# Strict mode records the ops of a backward pass too (the autograd engine's thread, while it
# runs a graph task): on a TPU each program call costs ~0.2 ms of host time, and a backward
# pass is most of a step's ops. They run as one program, with the optimizer's multi-tensor ops
# that follow, before the next other op. Debug mode runs each alone.
batch_backward = True
# Strict mode records every op it can (not only a backward pass and multi-tensor runs) and
# runs a region, rounded per op, when a value is needed, as fused mode does
# (``TPU_TRAIN_STRICT_RECORD=all``; ``backward`` records as described above). One program call
# per region instead of per op: on a TPU each call costs ~0.1 ms of host time, on the CPU
# client ~8 us. None (unset): the platform decides (records_everything_on), once it is chosen.
records_everything: bool | None = None
deferred = False  # outside fused mode, a region may hold ops not yet run
_mode = STRICT
_mode_listeners: list = []
_lock = threading.RLock()  # the autograd engine records backward ops from its own thread
_regions: dict = {}
_programs: dict = {}
_MAX_PROGRAMS = 512
_counts = {"ops_recorded": 0, "regions_run": 0, "programs_compiled": 0, "inputs_donated": 0}
_ARRAY_TYPE = None  # jax.Array's concrete class: known once a region exists (creating an
# array at import would start JAX's backends before a multi-process runtime can be joined)
_getrefcount = sys.getrefcount
_graph_task_id = torch._C._current_graph_task_id


def records_backward() -> bool:
    """Does strict mode record this op because it belongs to a backward pass (``batch_backward``
    and the autograd engine running a graph task on this thread)?"""
    return batch_backward and _graph_task_id() != -1


class EagerModeError(ValueError):
    """A bad eager-mode setting in the environment (the command line reports it as one line)."""


def region_size_from_environment() -> int:
    """``TPU_TRAIN_FUSED_MAX_OPS`` (default 8192): the ops a fused region holds at most."""
    value = os.environ.get(MAX_OPS_ENV, "")
    try:
        return max(1, int(value)) if value else 8192
    except ValueError:
        raise EagerModeError(f"{MAX_OPS_ENV}={value!r} is not a whole number of ops; unset it "
                             "or give a positive integer such as 8192") from None


_max_region_ops = 8192


class Pending:
    """The flat buffer an op recorded in fused mode will produce: its shape and dtype are
    known, its value once its region has run."""

    __slots__ = ("shape", "dtype", "region", "address", "array", "failure")

    def __init__(self, shape, dtype, region, address):
        """``dtype``: a ``numpy.dtype``, as a ``jax.Array``'s (``jnp.float32`` hashes apart)."""
        self.shape, self.dtype, self.region, self.address = shape, dtype, region, address
        self.array = self.failure = None

    def value(self) -> jax.Array:
        if self.array is None:
            if self.failure is not None:  # its region failed: every read says so
                raise self.failure
            self.region.flush()
            if self.array is None:  # pragma: no cover - a flush fills every live value
                raise RuntimeError("internal error: a pending tpu buffer was not computed")
        return self.array

    @property
    def aval(self):
        return jax.ShapeDtypeStruct(self.shape, self.dtype)


class Region:
    """The ops recorded on one device since its last flush."""

    def __init__(self, index: int):
        global _ARRAY_TYPE
        if _ARRAY_TYPE is None:
            # A transfer, not jnp.zeros: that would compile a program just to learn the type.
            _ARRAY_TYPE = type(jax.device_put(numpy.float32(0), runtime.jax_device(index)))
        self.index = index
        self._reset()

    def _reset(self):
        self.ops: list = []  # (body, wiring): wiring per input, int (region input) or (op, out)
        self.outputs: list = []  # per op: its Pending results
        self.inputs: list = []
        self.input_slots: dict = {}  # what an input is (see _wire) -> its position
        self.rounded_per_op = False  # holds strict mode's ops (see _ROUNDED_PER_OP)

    def _wire(self, value):
        if type(value) is Issued:  # a dispatch thread's call (strict mode's multi-tensor ops)
            value = dispatch_thread.value(value)
        if type(value) is Pending:
            if value.array is not None:
                value = value.array
            elif value.region is self:
                return value.address
            else:
                value = value.value()  # another device's region: run it first
        # One program input per distinct array, and per distinct scalar value: an optimizer
        # passes the same learning rate, betas and step count for every parameter, and each
        # input costs the program call a few µs.
        cls = type(value)
        if cls is _ARRAY_TYPE:
            key = id(value)  # the inputs list keeps the array, so its id stays unique
        elif cls is float:
            key = (float, value.hex())  # hex: -0.0 and nan are told apart exactly
        elif cls is numpy.ndarray and value.ndim == 0:
            key = (value.dtype.str, value.tobytes())
        else:
            self.inputs.append(value)
            return len(self.inputs) - 1
        slot = self.input_slots.get(key)
        if slot is None:
            slot = self.input_slots[key] = len(self.inputs)
            self.inputs.append(value)
        return slot

    def record(self, body, inputs, out_avals) -> list | None:
        """Append ``body(*inputs)`` (an op executable's traceable function); its results as
        :class:`Pending` buffers. None, recording nothing, where an input array spans several
        devices (a tensor sharded over a mesh): a region runs on one device, so the caller
        runs such an op alone."""
        global deferred
        if _spans_devices(inputs):
            return None
        with _lock:
            if not active:
                deferred = True  # strict mode's multi-tensor ops (batch_multi_tensor)
            if _mode == STRICT:
                self.rounded_per_op = True
            if len(self.ops) >= _max_region_ops:
                self.flush()
            # An earlier op's result in this region (most inputs) is wired inline: its address.
            wiring = tuple([v.address if type(v) is Pending and v.region is self
                            else self._wire(v) for v in inputs])
            position = len(self.ops)
            self.ops.append((body, wiring))
            if len(out_avals) == 1:  # most ops
                (shape, dtype), = out_avals
                results = [Pending(shape, dtype, self, (position, 0))]
            else:
                results = [Pending(shape, dtype, self, (position, j))
                           for j, (shape, dtype) in enumerate(out_avals)]
            self.outputs.append(results)
            # The caller's own list: its references keep the results live (flush counts them)
            # until the caller's tensors hold them.
            return results.copy()

    def flush(self) -> None:
        """Run the recorded ops as one program; every pending result still referenced gets
        its value."""
        with _lock:
            if not self.ops:
                return
            ops, outputs, inputs = self.ops, self.outputs, self.inputs
            rounded_per_op = self.rounded_per_op
            self._reset()
            _counts["ops_recorded"] += len(ops)  # counted as they leave the region (stats)
            live, pendings = [], []
            for results in outputs:
                for index in range(len(results)):
                    pending = results[index]
                    # Referenced by more than the results list, this variable and getrefcount's
                    # argument: a tensor still holds it, so it is an output of the program.
                    if _getrefcount(pending) > 3:
                        live.append(pending.address)
                        pendings.append(pending)
            donate = _donatable(inputs, pendings)
            key = (self.index, tuple(ops), tuple(live), donate, rounded_per_op)
            program = _programs.get(key)
            if program is None:
                program = _program(ops, live, donate, runtime.jax_device(self.index),
                                   rounded_per_op)
                _counts["programs_compiled"] += 1
                if len(_programs) >= _MAX_PROGRAMS:
                    _programs.clear()
                _programs[key] = program
            # Each value transferred once per device. A region's program runs on its one
            # device (its outputs are placed there), so every input is on that device too.
            for position in range(len(inputs)):
                if type(inputs[position]) is float:
                    inputs[position] = scalars.on_device(inputs[position], self.index)
            try:
                results = program(*inputs)
            except Exception as error:  # noqa: BLE001 - every pending result reports it
                _programs.pop(key, None)  # a failure may be transient (memory): retry next time
                failure = RuntimeError(
                    f"a tpu region of {len(ops)} recorded ops failed when it ran: {error} (run with "
                    f"{MODE_ENV}=debug to find the op)")
                for pending in pendings:
                    pending.failure, pending.region = failure, None
                raise failure from error
            _counts["regions_run"] += 1
            _counts["inputs_donated"] += len(donate)
            for pending, value in zip(pendings, results):
                pending.array = value
                pending.region = None


_SINGLE_DEVICE = jax.sharding.SingleDeviceSharding


def _spans_devices(inputs) -> bool:
    for value in inputs:
        if type(value) is _ARRAY_TYPE:
            sharding = value.sharding
            if type(sharding) is not _SINGLE_DEVICE and len(sharding.device_set) > 1:
                return True
    return False


def _donatable(inputs, pendings) -> tuple:
    """Region inputs whose buffer nothing else references (an optimizer's old parameter and
    state buffers, replaced by the region's writes) and that an output of the same shape can
    reuse: the program updates them in place instead of allocating. Each reference is
    counted: the input list, this loop's variable and ``getrefcount``'s argument."""
    wanted = {}
    for pending in pendings:
        aval = (pending.shape, pending.dtype)
        wanted[aval] = wanted.get(aval, 0) + 1
    donate = []
    for position in range(len(inputs)):  # not enumerate: its tuple would hold a reference
        value = inputs[position]
        if type(value) is _ARRAY_TYPE and _getrefcount(value) == 3:
            aval = (value.shape, value.dtype)
            if wanted.get(aval, 0) > 0:
                wanted[aval] -= 1
                donate.append(position)
    return tuple(donate)


# XLA may compute a chain of bf16 ops in float32 and round once at the end ("excess
# precision"): fused mode's programs do. Strict mode's recorded regions (a backward pass, an
# optimizer step) must give what running each op alone gives, so every op's result is rounded
# to its dtype there.
_ROUNDED_PER_OP = {"xla_allow_excess_precision": False}


def _region_options(rounded_per_op: bool) -> dict | None:
    """XLA options of a recorded region: compiled at the effort of eager mode's one-op
    programs (:func:`tpu_train.device.runtime.op_program_options`) and, in strict mode, rounded
    per op. A region is compiled in the user's first steps, and eager and fused steps are
    host-bound: on a v5e the least effort made W1's first fused step 13.7 s instead of 45.2 s,
    its fused steps after 8 % slower (docs/compile.md, "XLA's optimization effort")."""
    effort = runtime.op_program_options() or {}
    if rounded_per_op:
        return {**_ROUNDED_PER_OP, **effort}
    return effort or None


def _program(ops, live, donate, device, rounded_per_op):
    """One jitted function replaying ``ops`` (each the Python function an op's executable jits),
    its results on ``device`` (a region of fills only has no array input to place it by);
    ``rounded_per_op``: each op's results rounded to their dtypes, as when run alone.
    """

    def replay(*inputs):
        values = {}
        for position, (body, wiring) in enumerate(ops):
            args = [inputs[w] if type(w) is int else values[w] for w in wiring]
            for j, out in enumerate(body(*args)):
                values[(position, j)] = out
        return [values[address] for address in live]

    return jax.jit(replay, donate_argnums=donate,
                   out_shardings=jax.sharding.SingleDeviceSharding(device),
                   compiler_options=_region_options(rounded_per_op))


def region(index: int) -> Region:
    found = _regions.get(index)
    if found is None:
        with _lock:
            found = _regions.setdefault(index, Region(index))
    return found


def flush_all() -> None:
    global deferred
    with _lock:  # a recording thread sets ``deferred`` under it (Region.record)
        deferred = False
        for found in list(_regions.values()):
            found.flush()


def stats() -> dict:
    """Counts since the process started: ops recorded (in fused mode, and strict mode's runs of
    multi-tensor ops), regions run, region programs compiled (a loop that repeats one structure
    stops compiling after its first pass) and region inputs donated (old buffers the program
    overwrote in place)."""
    with _lock:
        counts = dict(_counts)
        # A region's ops are counted when it flushes: those still waiting count here.
        counts["ops_recorded"] += sum(len(found.ops) for found in _regions.values())
        return counts


def concrete(inputs: list) -> list:
    """``inputs`` with every pending buffer replaced by its value (running its region)."""
    return [v.value() if type(v) is Pending else v for v in inputs]


def aval_of(value):
    """What ``jax.eval_shape`` needs for an executable input."""
    return value.aval if type(value) is Pending else value


# ---------------------------------------------------------------------------------------------
# The mode
# ---------------------------------------------------------------------------------------------


def mode() -> str:
    return _mode


def set_mode(name: str) -> None:
    """Switch the process's eager mode; leaving ``fused`` runs what was recorded. The switch
    happens even where that run fails (its error is raised after it): a failed region must not
    leave the process recording."""
    global active, _max_region_ops
    if name not in MODES:
        raise ValueError(f"unknown tpu eager mode {name!r}; choose one of {', '.join(MODES)} "
                         f"(e.g. {MODE_ENV}=fused)")
    if name == FUSED or (name == STRICT and records_everything is not False):
        # Strict mode records too on a TPU (unset: the platform, chosen later, may say so).
        _max_region_ops = region_size_from_environment()
    # What one mode recorded runs as that mode's (strict's rounded per op) before another's.
    if (active or deferred) and name != _mode:
        active = False
        try:
            flush_all()
        finally:
            _enter(name)
    else:
        _enter(name)


def _enter(name: str) -> None:
    """Switch to ``name``; under the lock, as the platform's choice may settle strict mode's
    recording from another thread (:func:`_follow_platform`)."""
    global active, batch_multi_tensor, batch_backward, _mode
    with _lock:
        _mode = name
        active = name == FUSED or (name == STRICT and bool(records_everything))
        batch_multi_tensor = batch_backward = name == STRICT
        for listener in _mode_listeners:
            listener(name)


def on_mode_change(listener) -> None:
    """``listener(mode)`` after every switch (the op cache follows ``debug``)."""
    _mode_listeners.append(listener)


@contextlib.contextmanager
def eager_mode(name: str):
    """``with tpu_train.eager_mode("fused"): ...`` -- the mode inside the block, the previous
    one (and everything recorded, run) after it."""
    previous = _mode
    try:
        set_mode(name)  # may switch and then raise: what the previous mode recorded failed
        yield
    finally:
        set_mode(previous)


@contextlib.contextmanager
def strict_recording(everything: bool):
    """Strict mode recording every op it can (True) or only backward passes and multi-tensor
    runs (False) inside the block, whatever the platform or ``TPU_TRAIN_STRICT_RECORD`` chose;
    as before after it. What was recorded runs at the block's start and end."""
    global records_everything
    previous_mode, previous = _mode, records_everything
    set_mode(DEBUG)  # runs what the previous recording holds
    records_everything = everything
    try:
        set_mode(previous_mode)
        yield
    finally:
        try:
            set_mode(DEBUG)
        finally:
            records_everything = previous
            set_mode(previous_mode)


def strict_record_from_environment() -> bool | None:
    """``TPU_TRAIN_STRICT_RECORD``: ``all`` (True: strict mode records every op it can),
    ``backward`` (False) or unset (None: as :func:`records_everything_on` the platform)."""
    value = os.environ.get(STRICT_RECORD_ENV, "").strip().lower()
    if value and value not in STRICT_RECORDS:
        raise EagerModeError(f"{STRICT_RECORD_ENV}={value!r} is not a recording; use one of "
                             f"{', '.join(STRICT_RECORDS)} or unset it")
    return (value == "all") if value else None


def records_everything_on(platform_name: str) -> bool:
    """Does strict mode record every op by default on this platform? On a TPU, where a program
    call costs ~0.1 ms of host time, a strict step of transformers' tiny Llama is 2.6x torch
    CPU op by op and 1.1x recorded (docs/eager_performance.md); the CPU client's calls cost
    ~8 us, and there each op runs when called."""
    return platform_name == "tpu"


def _follow_platform(platform_name: str) -> None:
    """Settle an unset recording once the platform is chosen (before the first device op)."""
    global records_everything
    with _lock:
        if records_everything is not None:
            return
        records_everything = records_everything_on(platform_name)
        if records_everything and _mode == STRICT:
            _enter(STRICT)


runtime.on_platform_chosen(_follow_platform)


def mode_from_environment() -> str:
    value = os.environ.get(MODE_ENV, "").strip().lower()
    if not value:
        return STRICT
    if value not in MODES:
        raise EagerModeError(f"{MODE_ENV}={value!r} is not an eager mode; use one of "
                             f"{', '.join(MODES)} or unset it")
    return value
