"""Training batches built ahead in a worker process: off the training loop's critical path,
and off its GIL.

:class:`WorkerPrefetcher` starts a fresh Python process (never a fork: forking after the TPU
runtime and JAX started is unsafe), hands it the loader (its settings and state, pickled) and
reads back batches with the loader's state after each one. Up to ``depth`` batches are in
flight: the worker builds one per credit the consumer sends, so it stops ``depth`` ahead and
costs nothing while it waits.

Why a process rather than a thread (:class:`~tpu_train.data.prefetch.Prefetcher`):
``scripts/bench_data_pipeline.py`` simulates the loop of a compiled step (1 ms of Python
dispatch, then a 3.3 ms device wait that releases the GIL). A thread that parses and packs
holds the GIL when the loop wakes from its wait and delays it (docs/architecture.md, "Data
loading", has the figures); the worker process shares no GIL with the loop.

The worker imports only ``tpu_train.data`` (the package's ``__init__``, which loads the
device backend and JAX, is skipped: no second process ever touches the chip), ignores SIGINT
and SIGTERM (the training process turns those into a clean stop, and a terminal sends them to
the whole process group), encodes single-threaded unless ``TOKENIZERS_PARALLELISM`` is set
(the tokenizer's thread pool cost more CPU than it saved on chunks of tiny texts, and a worker
hides the latency), and exits when the training process closes its pipe or dies.

Resumability is that of the thread prefetcher: ``state_dict()`` is the loader's state after
the last batch the consumer received; ``load_state_dict()`` stops the worker, and the next
batch starts a new one at that position.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any, BinaryIO

import numpy
import torch

from tpu_train.data.prefetch import check_depth

_CREDIT = b"+"
# Runs in the worker: a namespace stands in for the tpu_train package so that importing
# tpu_train.data does not run tpu_train/__init__.py (torch backend, JAX, ops: seconds of CPU).
_BOOTSTRAP = """\
import sys, types
package = types.ModuleType("tpu_train")
package.__path__ = [sys.argv[1]]
sys.modules["tpu_train"] = package
from tpu_train.data.worker import serve
serve()
"""

_LIVE_WORKERS: "weakref.WeakSet[WorkerPrefetcher]" = weakref.WeakSet()


@atexit.register
def _close_live_workers() -> None:
    for prefetcher in list(_LIVE_WORKERS):
        prefetcher.close(timeout=2.0)


def _to_arrays(batch: dict) -> dict:
    # numpy arrays pickle as their bytes; a torch tensor pickles through torch.save's machinery.
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _to_tensors(batch: dict) -> dict:
    return {k: torch.from_numpy(v) if isinstance(v, numpy.ndarray) else v for k, v in batch.items()}


def _picklable(error: BaseException) -> BaseException:
    """``error`` itself if it survives pickling (a DataError does), else a RuntimeError that
    names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to pickle means: describe it instead
        return RuntimeError(f"{type(error).__name__}: {error}")


def serve() -> None:
    """The worker's main loop (stdin: the loader, then one credit per batch; stdout: batches)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # Batches go out on the original stdout; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    try:
        loader = pickle.load(requests)
        while requests.read(1) == _CREDIT:
            try:
                batch = next(loader)
            except StopIteration:
                pickle.dump(("end",), out)
                return
            pickle.dump(("batch", _to_arrays(batch), loader.state_dict()), out,
                        protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
    except BrokenPipeError:  # the training process is gone
        return
    except BaseException as error:  # noqa: BLE001 - reported to the consumer, raised there
        pickle.dump(("error", _picklable(error)), out)
    finally:
        try:
            out.close()
        except BrokenPipeError:
            pass


class WorkerPrefetcher:
    """Iterator over ``loader``'s batches, built up to ``depth`` ahead in a worker process.

    ``loader`` must pickle (a :class:`~tpu_train.data.packing.PackedLoader` does, as its
    settings and state) and have ``state_dict()``/``load_state_dict()``. It is not read here
    while a worker runs; it keeps the position to start a worker from. An error raised while
    building a batch (a :class:`~tpu_train.data.errors.DataError`) is raised by the ``next()``
    that would have returned that batch.
    """

    def __init__(self, loader: Any, depth: int = 2):
        self.loader, self.depth = loader, check_depth(depth)
        self._process: subprocess.Popen | None = None
        self._consumed_state = loader.state_dict()
        self._closed = self._done = False

    def start(self) -> None:
        """Start the worker now (it takes a second or two to import and open the data)
        instead of at the first ``next()``."""
        if self._closed:
            raise RuntimeError("WorkerPrefetcher is closed; create a new one to keep iterating")
        if self._process is not None:
            return
        env = dict(os.environ)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        package = Path(__file__).resolve().parent.parent
        self._process = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, str(package)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        _LIVE_WORKERS.add(self)
        self.loader.load_state_dict(self._consumed_state)
        self._send(pickle.dumps(self.loader) + _CREDIT * self.depth)

    def _send(self, data: bytes) -> None:
        try:
            self._process.stdin.write(data)
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # the worker ended: its last message (an error) or its absence is read next

    def __iter__(self) -> "WorkerPrefetcher":
        return self

    def __next__(self) -> dict:
        if self._done:
            raise StopIteration
        self.start()
        message = self._receive(self._process.stdout)
        if message[0] == "batch":
            _, batch, self._consumed_state = message
            self._send(_CREDIT)
            return _to_tensors(batch)
        self._done = True
        if message[0] == "end":
            raise StopIteration
        raise message[1]

    def _receive(self, pipe: BinaryIO) -> tuple:
        try:
            return pickle.load(pipe)
        except EOFError:
            code = self._process.wait()
            self._done = True
            raise RuntimeError(f"the data worker process ended (exit status {code}) without "
                               "a batch; its error, if any, is on stderr above") from None

    def state_dict(self) -> dict[str, Any]:
        """The loader's state just after the last batch this prefetcher returned."""
        return self._consumed_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: a running worker is stopped, and the next batch starts a
        new one there."""
        self._stop(timeout=10.0)
        self.loader.load_state_dict(state)
        self._consumed_state = state
        self._done = False

    def alive(self) -> bool:
        """Whether a worker process is running."""
        return self._process is not None and self._process.poll() is None

    def _stop(self, timeout: float) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        for pipe in (process.stdin, process.stdout):
            try:
                pipe.close()  # the worker reads the end of its input and exits
            except OSError:
                pass
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker (idempotent); ``state_dict()`` stays that of the last batch."""
        self._closed = True
        self._stop(timeout)

    def __enter__(self) -> "WorkerPrefetcher":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
