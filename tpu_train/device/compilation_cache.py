"""JAX's persistent compilation cache, on by default, and how to tell a load from a compile.

``TPU_TRAIN_CACHE_DIR`` names the directory XLA executables are kept in across processes:

* unset (or empty): ``$XDG_CACHE_HOME/tpu_train/xla``, else ``~/.cache/tpu_train/xla`` (an
  explicit ``jax_compilation_cache_dir`` set through JAX's own config is then kept);
* ``off`` (also ``0``, ``false``, ``no``, ``none``, ``disabled``): no persistent cache, nothing
  is written;
* a path: that directory (``~`` expanded, made absolute, created). A value that is not a
  usable local directory (a file, not writable, a ``scheme://`` URL) is an error naming the
  variable, raised by :func:`configure` -- which the device runtime calls before anything is
  compiled.

Settings (see ``docs/compile.md``): on the CPU client programs whose XLA compile took under
:data:`MIN_COMPILE_TIME_S` are not written (the eager mode's per-op executables compile in
milliseconds there: caching them would fill the disk with thousands of entries that save
nothing); on a TPU every program is (:func:`min_compile_time_s`: the smallest takes ~43 ms to
compile and ~2.3 ms to read back); no entry under :data:`MIN_ENTRY_SIZE_BYTES`; the directory is bounded to
:data:`MAX_SIZE_BYTES` (``TPU_TRAIN_CACHE_MAX_GB`` overrides), least recently used entries
evicted first.

Several processes may share one directory: a size bound turns on JAX's LRU cache with its file
lock (``<dir>/.lockfile``, from the ``filelock`` package torch already depends on) around every
read and write. Without a bound, JAX 0.10's file cache writes an entry with a plain
``Path.write_bytes`` after an ``exists()`` check -- neither atomic nor locked -- so a process
could read another's half-written entry (JAX would then warn and recompile).

:func:`hits` counts persistent-cache hits in the calling thread, from JAX's monitoring event
``/jax/compilation_cache/cache_hits`` (recorded in the thread that compiles): the difference
across one ``lowered.compile()`` says whether its executable was loaded or compiled.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

CACHE_DIR_ENV = "TPU_TRAIN_CACHE_DIR"
MAX_SIZE_ENV = "TPU_TRAIN_CACHE_MAX_GB"
OFF_VALUES = frozenset({"off", "0", "false", "no", "none", "disabled"})
# Measured (docs/compile.md): the debug_tiny train step takes 2.3 s of XLA compile, a 70B plan's
# step minutes; eager per-op programs take 5-60 ms. 1 s (JAX's own default) keeps every train
# step and no per-op program.
MIN_COMPILE_TIME_S = 1.0
# On a v5e the smallest program (an add at the least effort) takes 42-44 ms of XLA compile and
# 2.1-2.3 ms to read back from the cache, an entry of ~11 KB: every program is worth keeping.
TPU_MIN_COMPILE_TIME_S = 0.0
MIN_ENTRY_SIZE_BYTES = 0
MAX_SIZE_BYTES = 20 * 2**30

_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompilationCacheError(RuntimeError):
    pass


def _default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    root = Path(base).expanduser() if base else Path.home() / ".cache"
    return root / "tpu_train" / "xla"


def requested_dir() -> Path | None:
    """The directory ``TPU_TRAIN_CACHE_DIR`` asks for (default when unset), None when off.
    Validates the value only; nothing is created."""
    raw = os.environ.get(CACHE_DIR_ENV)
    value = (raw or "").strip()
    if value.lower() in OFF_VALUES:
        return None
    if not value:
        return _default_dir()
    if "://" in value:
        raise CompilationCacheError(
            f"{CACHE_DIR_ENV}={raw!r}: only a local directory is supported (or 'off')")
    return Path(value).expanduser().absolute()


def _max_size_bytes() -> int:
    raw = os.environ.get(MAX_SIZE_ENV, "").strip()
    if not raw:
        return MAX_SIZE_BYTES
    try:
        size = float(raw)
    except ValueError:
        size = -1.0
    if not size > 0:
        raise CompilationCacheError(
            f"{MAX_SIZE_ENV}={raw!r} is not a positive number of GiB (unset it for "
            f"{MAX_SIZE_BYTES // 2**30} GiB)")
    return int(size * 2**30)


def _usable(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CompilationCacheError(
            f"{CACHE_DIR_ENV}: cannot create the compilation cache directory {str(path)!r} "
            f"({error.strerror or error}); set {CACHE_DIR_ENV} to a writable directory or "
            "to 'off'") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CompilationCacheError(
            f"{CACHE_DIR_ENV}: the compilation cache directory {str(path)!r} is not writable; "
            f"set {CACHE_DIR_ENV} to a writable directory or to 'off'")
    return path


_lock = threading.Lock()
_configured: tuple | None = None  # (directory or None,) once configured
_local = threading.local()
_listening = False


def _on_event(event: str, **_kwargs) -> None:
    if event == _HIT_EVENT:
        _local.hits = getattr(_local, "hits", 0) + 1


def _listen(jax) -> None:
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_on_event)
        _listening = True


def configure(jax=None) -> Path | None:
    """Point JAX's persistent cache at ``TPU_TRAIN_CACHE_DIR`` (once per process; later calls
    return the first answer). Returns the directory in use, or None when off."""
    global _configured
    if _configured is not None:
        return _configured[0]
    with _lock:
        if _configured is not None:
            return _configured[0]
        if jax is None:
            import jax
        _listen(jax)
        explicit = os.environ.get(CACHE_DIR_ENV, "").strip()
        directory = requested_dir()
        if directory is None:
            jax.config.update("jax_enable_compilation_cache", False)
        elif not explicit and jax.config.jax_compilation_cache_dir:
            directory = Path(jax.config.jax_compilation_cache_dir)  # the user's JAX setting
        else:
            directory = _usable(directory)
            jax.config.update("jax_compilation_cache_dir", str(directory))
        if directory is not None:
            jax.config.update("jax_compilation_cache_max_size", _max_size_bytes())
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", MIN_ENTRY_SIZE_BYTES)
        _configured = (directory,)
        return directory


def min_compile_time_s(platform_name: str) -> float:
    """Programs that compile faster than this on ``platform_name`` are not written."""
    return TPU_MIN_COMPILE_TIME_S if platform_name == "tpu" else MIN_COMPILE_TIME_S


def follow_platform(platform_name: str) -> None:
    """The platform's threshold (:func:`min_compile_time_s`), once the platform is chosen;
    nothing where the cache is off."""
    if configure() is not None:
        import jax

        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          min_compile_time_s(platform_name))


def directory() -> Path | None:
    """The persistent cache directory of this process (configuring it if needed), None if off."""
    return configure()


def hits() -> int:
    """Persistent-cache hits so far in the calling thread (compare before and after a compile)."""
    return getattr(_local, "hits", 0)
