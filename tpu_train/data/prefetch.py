"""Background prefetching of batches onto a device.

A daemon thread pulls batches from any iterator of dicts, moves their tensors to the device
(``.to(device, non_blocking=True)`` by default) and keeps up to ``depth`` ready, so the transfer
of batch ``n + 1`` overlaps the step on batch ``n``.

Resumability: after pulling each batch the thread also snapshots the source's
``state_dict()``. ``DevicePrefetcher.state_dict()`` returns the snapshot that belongs to the
last batch the *consumer* received, so batches that were prefetched but not consumed are
produced again after a resume instead of being skipped.
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
_LIVE_PREFETCHERS: "weakref.WeakSet[DevicePrefetcher]" = weakref.WeakSet()


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


class _Failure:
    """Carries an exception raised in the worker thread to the consumer."""

    def __init__(self, error: BaseException):
        self.error = error


_END = object()


class DevicePrefetcher:
    """Iterator over ``source``'s batches, already on ``device``.

    Args:
        source: any iterable of batches (dicts of tensors, or nested lists/tuples/dicts).
            If it has ``state_dict()``/``load_state_dict()`` the prefetcher is resumable.
        device: target torch device (any type: cpu, cuda, tpu, ...).
        depth: batches kept ready ahead of the consumer (>= 1).
        transfer: ``batch -> batch on device``; defaults to :func:`move_batch`.
        pin_memory: pin CPU tensors first (useful for CUDA).

    Use as a context manager, or call :meth:`close`; the thread is a daemon and is stopped at
    interpreter exit, so an abandoned prefetcher neither blocks nor crashes the exit. ``load_state_dict`` must come before the first
    batch is requested (the worker starts lazily).
    """

    def __init__(
        self,
        source: Iterable,
        device: torch.device | str,
        depth: int = 2,
        transfer: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
    ):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.source = source
        self.device = torch.device(device)
        self.depth = depth
        self._transfer = transfer or (lambda b: move_batch(b, self.device, True, pin_memory))
        self._resumable = hasattr(source, "state_dict") and hasattr(source, "load_state_dict")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._done = False
        self._consumed_state = source.state_dict() if self._resumable else None

    # -- worker ----------------------------------------------------------------------------

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            iterator = iter(self.source)
            while not self._stop.is_set():
                try:
                    batch = next(iterator)
                except StopIteration:
                    self._put(_END)
                    return
                state = self.source.state_dict() if self._resumable else None
                if not self._put((self._transfer(batch), state)):
                    return
        except BaseException as error:  # surfaced in the consumer, never lost in the thread
            self._put(_Failure(error))

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="device-prefetch", daemon=True)
            _LIVE_PREFETCHERS.add(self)
            self._thread.start()

    # -- consumer --------------------------------------------------------------------------

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._stop.is_set():
            raise RuntimeError("DevicePrefetcher is closed; create a new one to keep iterating")
        self._start()
        while True:
            try:
                item = self._queue.get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError("prefetch worker stopped without a result") from None
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        batch, state = item
        self._consumed_state = state
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The source's state just after the last batch this prefetcher returned."""
        if not self._resumable:
            raise TypeError(f"{type(self.source).__name__} has no state_dict(); it cannot be resumed")
        return self._consumed_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the source; only allowed before the first batch is requested."""
        if not self._resumable:
            raise TypeError(f"{type(self.source).__name__} has no load_state_dict(); it cannot be resumed")
        if self._thread is not None:
            raise RuntimeError("load_state_dict must be called before iterating the DevicePrefetcher")
        self.source.load_state_dict(state)
        self._consumed_state = state

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker and drop prefetched batches (idempotent)."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "DevicePrefetcher":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
