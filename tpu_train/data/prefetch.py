"""Batches built ahead of the consumer on a background thread, and moved to a device.

:class:`Prefetcher` pulls batches from any iterator on a daemon thread and keeps up to
``depth`` ready, so that building batch ``n + 1`` overlaps the work on batch ``n``.
:class:`DevicePrefetcher` also moves each batch's tensors to a device
(``.to(device, non_blocking=True)`` by default), so that the transfer overlaps the step too.
The trainer builds files' batches in a worker process instead
(:class:`~tpu_train.data.worker.WorkerPrefetcher`): a thread that parses and packs shares the
GIL with the training loop and delays it (docs/architecture.md, "Data loading"); it keeps a
thread for loaders that cost next to nothing (random tokens).

Resumability: after pulling each batch the thread also snapshots the source's
``state_dict()``. ``state_dict()`` returns the snapshot that belongs to the last batch the
*consumer* received, so batches that were prefetched but not consumed are produced again after
a resume instead of being skipped. ``load_state_dict()`` may come at any time: it stops the
worker, drops what it had built, and the next batch is read from the loaded position.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

_POLL_SECONDS = 0.1

# Workers still running at interpreter exit are stopped and joined first: a daemon thread left
# inside torch while the interpreter tears torch down aborts the process ("terminate called").
_LIVE_PREFETCHERS: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()


@atexit.register
def _close_live_prefetchers() -> None:
    for prefetcher in list(_LIVE_PREFETCHERS):
        prefetcher.close(timeout=2.0)


def move_batch(batch: Any, device: torch.device | str, non_blocking: bool = True, pin_memory: bool = False) -> Any:
    """``batch`` with every tensor (in dicts, lists and tuples, recursively) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        if pin_memory and batch.device.type == "cpu":
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: move_batch(v, device, non_blocking, pin_memory) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_batch(v, device, non_blocking, pin_memory) for v in batch)
    return batch


def check_depth(depth: Any) -> int:
    """``depth`` (batches built ahead), or ``ValueError`` unless it is an int >= 1."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth!r}")
    return depth


class _Failure:
    """Carries an exception raised in the worker thread to the consumer."""

    def __init__(self, error: BaseException):
        self.error = error


_END = object()


class _Worker:
    """One background thread filling one queue until the source ends or ``stop`` is set.
    A rewind replaces the whole worker: an old thread still finishing its batch can only put
    into its own, abandoned queue."""

    def __init__(self, prefetcher: "Prefetcher"):
        self.queue: queue.Queue = queue.Queue(maxsize=prefetcher.depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._work, args=(prefetcher,),
                                       name="batch-prefetch", daemon=True)

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, prefetcher: "Prefetcher") -> None:
        source = prefetcher.source
        try:
            iterator = iter(source)
            while not self.stop.is_set():
                try:
                    batch = next(iterator)
                except StopIteration:
                    self._put(_END)
                    return
                state = source.state_dict() if prefetcher.resumable else None
                if not self._put((prefetcher.transform(batch), state)):
                    return
        except BaseException as error:  # surfaced in the consumer, never lost in the thread
            self._put(_Failure(error))

    def halt(self, timeout: float | None) -> None:
        """Stop the thread and drop what it built; waits for it (up to ``timeout``)."""
        self.stop.set()
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        self.thread.join(timeout)


class Prefetcher:
    """Iterator over ``source``'s batches, built up to ``depth`` ahead on a background thread.

    Args:
        source: any iterable of batches. If it has ``state_dict()``/``load_state_dict()`` the
            prefetcher is resumable (the trainer's loaders are).
        depth: batches kept ready ahead of the consumer (>= 1).
        transform: applied to each batch on the thread (default: none).

    The thread starts with the first batch asked for (or :meth:`start`). Use as a context
    manager, or call :meth:`close`; the thread is a daemon and is stopped at interpreter exit,
    so an abandoned prefetcher neither blocks nor crashes the exit. An exception raised while
    building a batch is raised by the ``next()`` that would have returned that batch.
    """

    def __init__(self, source: Iterable, depth: int = 2,
                 transform: Callable[[Any], Any] | None = None):
        self.source = source
        self.depth = check_depth(depth)
        self.transform = transform or (lambda batch: batch)
        self.resumable = hasattr(source, "state_dict") and hasattr(source, "load_state_dict")
        self._worker: _Worker | None = None
        self._closed = False
        self._done = False
        self._consumed_state = source.state_dict() if self.resumable else None

    def start(self) -> None:
        """Begin building batches now instead of at the first ``next()``."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; create a new one to keep "
                               "iterating")
        if self._worker is None:
            self._worker = _Worker(self)
            _LIVE_PREFETCHERS.add(self)
            self._worker.thread.start()

    def alive(self) -> bool:
        """Whether a worker thread is running."""
        return self._worker is not None and self._worker.thread.is_alive()

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        self.start()
        worker = self._worker
        while True:
            try:
                item = worker.queue.get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                if not worker.thread.is_alive() and worker.queue.empty():
                    self._done = True
                    raise RuntimeError("prefetch worker stopped without a result") from None
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        batch, self._consumed_state = item
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The source's state just after the last batch this prefetcher returned."""
        if not self.resumable:
            raise TypeError(f"{type(self.source).__name__} has no state_dict(); it cannot be resumed")
        return self._consumed_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`): the worker, if running, is stopped
        and its prefetched batches dropped; the next batch is read from ``state``."""
        if not self.resumable:
            raise TypeError(f"{type(self.source).__name__} has no load_state_dict(); it cannot be resumed")
        if self._worker is not None:
            # The source is the worker's until it has stopped: wait for it, however long its
            # batch takes, before the source is touched here.
            self._worker.halt(timeout=None)
            self._worker = None
        self.source.load_state_dict(state)
        self._consumed_state = state
        self._done = False

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker and drop prefetched batches (idempotent)."""
        self._closed = True
        if self._worker is not None:
            self._worker.halt(timeout)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.stop.set()


class DevicePrefetcher(Prefetcher):
    """Iterator over ``source``'s batches, already on ``device``.

    Args:
        source: any iterable of batches (dicts of tensors, or nested lists/tuples/dicts).
            If it has ``state_dict()``/``load_state_dict()`` the prefetcher is resumable.
        device: target torch device (any type: cpu, cuda, tpu, ...).
        depth: batches kept ready ahead of the consumer (>= 1).
        transfer: ``batch -> batch on device``; defaults to :func:`move_batch`.
        pin_memory: pin CPU tensors first (useful for CUDA).
    """

    def __init__(
        self,
        source: Iterable,
        device: torch.device | str,
        depth: int = 2,
        transfer: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
    ):
        self.device = torch.device(device)
        super().__init__(source, depth,
                         transfer or (lambda b: move_batch(b, self.device, True, pin_memory)))
