"""Strict mode's program calls on a thread of their own (opt-in: ``TPU_TRAIN_DISPATCH_THREAD=1``).

On a TPU a strict op's program call costs the host far more than the op path's own Python
(docs/eager_performance.md). JAX releases the GIL while PJRT runs a call, so a second thread
making the calls lets the op path go on to the next op meanwhile. An op whose executable is
cached hands ``(executable, inputs)`` to this thread and gets :class:`Issued` placeholders for
its output buffers at once (their shapes and dtypes are known); its storages hold them.

The thread runs the calls in the order they were issued, so when it reaches a call, every
placeholder among its inputs has been filled by an earlier one. Anything else that needs a
buffer's value (a read to the host, a synchronous op, a fused region, a compiled step) waits for
the placeholder first (:func:`value`). A program input stays referenced by its queued call until
the call is made, so the reference counts that decide donation still see it.
"""

from __future__ import annotations

import os
import queue
import threading

ENV = "TPU_TRAIN_DISPATCH_THREAD"
enabled = os.environ.get(ENV, "") not in ("", "0")

_queue: queue.SimpleQueue = queue.SimpleQueue()
_start_lock = threading.Lock()
_thread: threading.Thread | None = None


class Issued:
    """A program output the dispatch thread has not returned yet."""

    __slots__ = ("shape", "dtype", "array", "failure")

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype
        self.array = self.failure = None


class _Barrier:
    __slots__ = ("event",)

    def __init__(self):
        self.event = threading.Event()


def _run() -> None:
    get = _queue.get
    while True:
        job = get()
        if type(job) is _Barrier:
            job.event.set()
            continue
        fn, inputs, outputs, func = job
        job = None
        try:
            for position in range(len(inputs)):
                value = inputs[position]
                if type(value) is Issued:
                    if value.failure is not None:
                        raise value.failure
                    inputs[position] = value.array
            flat = fn(*inputs)
            for placeholder, array in zip(outputs, flat):
                placeholder.array = array
        except BaseException as error:  # noqa: BLE001 - reported where the value is read
            failure = RuntimeError(f"tpu op {func} failed on the device: {error}")
            for placeholder in outputs:
                placeholder.failure = failure
        # Drop the inputs now: their reference counts decide donation elsewhere.
        fn = inputs = outputs = flat = value = None


def _ensure_started() -> None:
    global _thread
    with _start_lock:
        if _thread is None:
            _thread = threading.Thread(target=_run, name="tpu-dispatch", daemon=True)
            _thread.start()


def issue(fn, inputs: list, out_avals, func) -> list:
    """Queue ``fn(*inputs)``; its outputs as :class:`Issued` placeholders, one per
    ``(shape, dtype)`` of ``out_avals``."""
    if _thread is None:
        _ensure_started()
    outputs = [Issued(shape, dtype) for shape, dtype in out_avals]
    _queue.put((fn, inputs, outputs, func))
    return outputs


def drain() -> None:
    """Wait until every call issued so far has been made."""
    if _thread is None:
        return
    barrier = _Barrier()
    _queue.put(barrier)
    barrier.event.wait()


def value(placeholder: Issued):
    """The placeholder's array, once the dispatch thread has made its call."""
    if placeholder.array is None and placeholder.failure is None:
        drain()
    if placeholder.failure is not None:
        raise placeholder.failure
    return placeholder.array


def resolve(inputs: list) -> None:
    """Replace the placeholders among an executable's ``inputs`` by their arrays, in place (an
    op about to run on the calling thread)."""
    for position in range(len(inputs)):
        if type(inputs[position]) is Issued:
            inputs[position] = value(inputs[position])
