"""Compiled-program cache with recompilation diagnostics.

A compiled step is specialised to its *signature*: the shape, dtype and placement of every
input (named like ``batch["tokens"]``, ``param "layers.0.wq.weight"``,
``optimizer state "exp_avg" of "..."``) and the static settings baked into the program
(optimizer hyper-parameters, ``max_grad_norm``, train/eval mode...). Every compilation is
logged on the ``tpu_train.compile`` logger with its cause — the first call, or exactly which
inputs or settings differ from the previous call, from what to what — and how long tracing,
lowering and XLA compilation took -- or, when XLA's executable came from the persistent
compilation cache (:mod:`tpu_train.device.compilation_cache`), how long loading it took. A step function compiled more than ``warn_after`` times
logs a warning: recompiling every few steps usually means a shape that should be fixed
(pad or bucket sequence lengths) or a setting changed in a loop.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, NamedTuple

from tpu_train.device import compilation_cache

logger = logging.getLogger("tpu_train.compile")

DEFAULT_WARN_AFTER = 8
_MAX_LISTED = 6


class InputSpec(NamedTuple):
    """One program input as the cache sees it (a tuple: every call builds one per input, and
    a compiled step has hundreds, so construction and hashing stay in C)."""

    name: str
    shape: tuple
    dtype: Any
    placement: Any = None  # sharding / device, when it matters
    stored: tuple | None = None  # the argument's own shape, where the program reshapes it

    def describe(self) -> str:
        text = f"shape {self.shape} dtype {self.dtype}"
        if self.stored is not None:
            text = f"{text} (stored as {self.stored})"
        return text if self.placement is None else f"{text} on {self.placement}"


@dataclasses.dataclass(frozen=True)
class Signature:
    """Everything a compiled program is specialised to (hashable)."""

    inputs: tuple  # of InputSpec
    settings: tuple  # of (name, value)


def describe_changes(old: Signature, new: Signature) -> list[str]:
    """Human-readable differences between two signatures, inputs first."""
    changes: list[str] = []
    old_inputs = {spec.name: spec for spec in old.inputs}
    new_inputs = {spec.name: spec for spec in new.inputs}
    for name, spec in new_inputs.items():
        before = old_inputs.get(name)
        if before is None:
            changes.append(f"{name} is new ({spec.describe()})")
            continue
        if before.shape != spec.shape:
            changes.append(f"{name} changed shape from {before.shape} to {spec.shape}")
        if before.dtype != spec.dtype:
            changes.append(f"{name} changed dtype from {before.dtype} to {spec.dtype}")
        if before.placement != spec.placement:
            changes.append(f"{name} moved from {before.placement} to {spec.placement}")
        if before.stored != spec.stored:
            changes.append(f"{name} is stored as {spec.stored or spec.shape}, was "
                           f"{before.stored or before.shape}")
    for name in old_inputs:
        if name not in new_inputs:
            changes.append(f"{name} is gone (was {old_inputs[name].describe()})")
    old_settings, new_settings = dict(old.settings), dict(new.settings)
    for name, value in new_settings.items():
        if name not in old_settings:
            changes.append(f"setting {name} is new ({value!r})")
        elif old_settings[name] != value:
            changes.append(f"setting {name} changed from {old_settings[name]!r} to {value!r}")
    for name in old_settings:
        if name not in new_settings:
            changes.append(f"setting {name} is gone (was {old_settings[name]!r})")
    return changes or ["signature differs in input order"]


@dataclasses.dataclass
class CompileRecord:
    """One compilation: why it happened and what it cost."""

    cause: str
    trace_s: float
    lower_s: float
    compile_s: float  # XLA's compile, or the load from the persistent cache (``from_cache``)
    graph_nodes: int
    from_cache: bool = False  # the executable was loaded from the persistent compilation cache
    scanned_layers: int = 0  # layers run inside lax.scan loops (``scan_layers``)
    # Layers called as one body traced once per stack (``shared_layers``).
    shared_layer_calls: int = 0
    # Why PyTorch's backward was traced where JAX would have differentiated the forward.
    autodiff_fallback: str = ""
    # Compiled ahead of its first call (``CompileCache.build_ahead``): how long that call
    # still waited for XLA; None when the call itself compiled.
    waited_s: float | None = None
    # Loaded from a saved executable (``CompiledTrainStep.load_executable``) instead of
    # compiled: how long deserializing it took (``compile_s`` is then 0), and its path.
    load_s: float = 0.0
    loaded_from: str | None = None

    @property
    def total_s(self) -> float:
        return self.trace_s + self.lower_s + self.compile_s + self.load_s


class TimedStages:
    """Collects the duration of the trace / lower / compile stages of one build."""

    def __init__(self):
        self.seconds = {"trace": 0.0, "lower": 0.0, "compile": 0.0}
        # A saved executable read in place of the compile (tpu_train.compile.saved_executable).
        self.load_s = 0.0
        self.loaded_from: str | None = None
        self.graph_nodes = 0
        self.scanned_layers = 0
        self.shared_layer_calls = 0
        self.autodiff_fallback = ""
        self.compiles = 0  # calls timed as the "compile" stage
        self.cache_hits = 0  # of which JAX loaded the executable from the persistent cache

    @property
    def from_cache(self) -> bool:
        """Every XLA executable of this build was loaded from the persistent cache."""
        return self.compiles > 0 and self.cache_hits >= self.compiles

    def time(self, stage: str, fn: Callable, *args, **kwargs):
        hits = compilation_cache.hits()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[stage] += time.perf_counter() - start
            if stage == "compile":
                self.compiles += 1
                self.cache_hits += compilation_cache.hits() - hits


class _Ahead:
    """A program lowered on the caller's thread whose XLA compile runs on a thread of its own
    (XLA releases the GIL while it compiles): :meth:`wait` joins it and returns the program,
    or raises the compile's error on the waiting thread."""

    def __init__(self, cause: str, stages: TimedStages, entry: Any,
                 compile: Callable[[Any, TimedStages], Any]):
        self.cause, self.stages = cause, stages
        self._outcome: tuple[Any, BaseException | None] = (None, None)

        def run() -> None:
            try:
                self._outcome = (compile(entry, stages), None)
            except BaseException as error:  # noqa: BLE001 - re-raised by wait()
                self._outcome = (None, error)

        # Not a daemon: a process that ends before the first call waits for XLA to finish
        # rather than tearing the runtime down under a running compile.
        self._thread = threading.Thread(target=run, name="tpu_train ahead-of-time compile")
        self._thread.start()

    def wait(self) -> tuple[Any, float]:
        """(the compiled program, seconds waited for it)."""
        started = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - started
        entry, error = self._outcome
        if error is not None:
            raise error
        return entry, waited


class CompileCache:
    """Programs keyed by :class:`Signature`, with logged and counted compilations."""

    def __init__(self, name: str, warn_after: int = DEFAULT_WARN_AFTER):
        self.name = name
        self.warn_after = int(warn_after)
        self.entries: dict[Signature, Any] = {}
        self.records: list[CompileRecord] = []
        self._last: Signature | None = None
        self._last_entry: Any = None

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def last_entry(self) -> Any:
        """The program the latest :meth:`get_or_build` returned (None before the first): what
        the benchmarks time or stand a stub in for (``entry.executable``)."""
        return self._last_entry

    def get_or_build(self, signature: Signature, build: Callable[[TimedStages], Any]):
        """The program for ``signature``; ``build(stages)`` makes it on a miss (timed, logged)."""
        if signature is self._last:  # the caller reuses its signature object when unchanged
            return self._last_entry
        entry = self.entries.get(signature)
        if isinstance(entry, _Ahead):
            # Removed first: after a failed compile the next call builds the program anew.
            ahead = self.entries.pop(signature)
            entry, waited = ahead.wait()
            self.entries[signature] = entry
            self._record(ahead.cause, ahead.stages, waited_s=waited)
        elif entry is None:
            cause = self._cause(signature)
            stages = TimedStages()
            entry = build(stages)
            self.entries[signature] = entry
            self._record(cause, stages)
        self._last, self._last_entry = signature, entry
        return entry

    def build_ahead(self, signature: Signature, lower: Callable[[TimedStages], Any],
                    compile: Callable[[Any, TimedStages], Any]) -> bool:
        """Start building the program for ``signature`` before its first call: ``lower(stages)``
        traces and lowers it now, on this thread; ``compile(lowered entry, stages)`` returns the
        compiled entry and runs on a thread of its own, while this one goes on. The first
        :meth:`get_or_build` of ``signature`` waits for it (its record says how long) and raises
        what the compile raised. False (and nothing built) where ``signature`` is built already.
        """
        if signature in self.entries:
            return False
        cause = self._cause(signature)
        stages = TimedStages()
        self.entries[signature] = _Ahead(cause, stages, lower(stages), compile)
        return True

    def _cause(self, signature: Signature) -> str:
        if self._last is None:
            return "first call"
        changes = describe_changes(self._last, signature)
        listed = "; ".join(changes[:_MAX_LISTED])
        if len(changes) > _MAX_LISTED:
            listed += f"; and {len(changes) - _MAX_LISTED} more"
        return listed

    def _record(self, cause: str, stages: TimedStages, waited_s: float | None = None) -> None:
        s = stages.seconds
        record = CompileRecord(cause, s["trace"], s["lower"], s["compile"], stages.graph_nodes,
                               from_cache=stages.from_cache,
                               scanned_layers=stages.scanned_layers,
                               shared_layer_calls=stages.shared_layer_calls,
                               autodiff_fallback=stages.autodiff_fallback, waited_s=waited_s,
                               load_s=stages.load_s, loaded_from=stages.loaded_from)
        self.records.append(record)
        count = len(self.records)
        xla = "loaded from the compilation cache in" if record.from_cache else "XLA compile"
        if record.loaded_from is not None:
            xla = f"loaded from {record.loaded_from} in {record.load_s:.2f}s, XLA compile"
        fallback = (f"; PyTorch's backward traced ({record.autodiff_fallback})"
                    if record.autodiff_fallback else "")
        logger.info(
            "%s: compilation #%d (%s): trace %.2fs, lower %.2fs, %s %.2fs, "
            "%d graph nodes, %d layers scanned, %d layer calls of shared bodies%s", self.name,
            count, cause, record.trace_s, record.lower_s, xla, record.compile_s,
            record.graph_nodes, record.scanned_layers, record.shared_layer_calls, fallback)
        if count > self.warn_after:
            logger.warning(
                "%s has compiled %d times (more than %d): the latest because %s. Each "
                "recompilation costs %.1fs; keep input shapes and settings fixed (pad or bucket "
                "variable lengths)", self.name, count, self.warn_after, cause, record.total_s)
