"""The PJRT client, reached through JAX: platform choice and device enumeration.

``TPU_TRAIN_PLATFORM`` picks the PJRT platform (``tpu``, ``cuda`` or ``cpu``); unset, the best
one present wins (tpu, then cuda, then cpu), with one exception: on a host that has TPU chips
(:mod:`tpu_train.device.tpu_host`) but where JAX cannot use them, the choice is an error naming
the cause instead of a silent fall-back to the host CPU. Every other module asks this one for
devices, so the choice is made once per process. The same first call configures JAX's
persistent compilation cache (``TPU_TRAIN_CACHE_DIR``, :mod:`tpu_train.device.compilation_cache`),
so it is in place before anything is compiled.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform as _platform
import sys
import tempfile
import threading
from typing import NoReturn

from tpu_train.device import host_memory, tpu_host

PLATFORM_ENV = "TPU_TRAIN_PLATFORM"
_PREFERENCE = ("tpu", "cuda", "cpu")
# JAX names the CUDA plugin's platform "gpu" in some places and "cuda" in others.
_JAX_ALIASES = {"cuda": ("cuda", "gpu"), "tpu": ("tpu",), "cpu": ("cpu",)}
TPU_INSTALL = "pip install -c constraints.txt 'tpu_train[tpu]' (docs/tpu.md)"


class PlatformError(RuntimeError):
    pass


def _jax():
    import jax

    # The torch dtype is authoritative and int64 is stored as int32 (see ops.dtypes); a
    # 64-bit JAX would silently change every integer and index type in compiled programs.
    jax.config.update("jax_enable_x64", False)
    from tpu_train.device import compilation_cache

    compilation_cache.configure(jax)
    return jax


def _available(jax, name: str) -> bool:
    # JAX logs its own guess at a missing TPU or GPU plugin while it starts its backends; the
    # caller reports an absent platform itself, as one line with the cause.
    quiet = logging.getLogger("jax._src.xla_bridge")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        for alias in _JAX_ALIASES[name]:
            try:
                if jax.devices(alias):
                    return True
            except RuntimeError:
                continue
        return False
    finally:
        quiet.setLevel(level)


def requested_platform() -> str | None:
    """The platform named by ``TPU_TRAIN_PLATFORM`` (validated), or None when unset."""
    requested = os.environ.get(PLATFORM_ENV, "").strip().lower()
    if not requested:
        return None
    if requested not in _PREFERENCE:
        raise PlatformError(
            f"{PLATFORM_ENV}={requested!r} is not a known platform; use one of "
            f"{', '.join(_PREFERENCE)} (or unset it to pick the best one present)")
    return requested


# The thread opening the backend ahead of its first use (open_in_background), if any.
_opener: threading.Thread | None = None


def open_in_background() -> None:
    """Start the backend (the platform choice and JAX's devices) on a thread of its own, so
    that the host work before the first device use (a tokenizer, data files, a model read from
    disk) goes on meanwhile: opening a TPU chip takes seconds. The first :func:`platform` or
    :func:`devices` of any other thread waits for it; an error is left to that call, which
    makes it again and raises it (errors of the environment's settings are raised here, by
    :func:`_prepare`). Call it once the job's processes are joined, or where there is one
    (``jax.distributed`` must start before the backends do); ``tpu-train`` calls it while
    ``import tpu_train`` runs (:mod:`tpu_train.startup`).

    While it runs, what this process writes to its stderr is held back with the native
    start-up output (:func:`_native_start_up_output`) and written when the backend is open
    (dropped by :func:`exit_without_waiting`)."""
    global _opener
    if _opener is not None or devices_enumerated():
        return
    # Here, before the thread: an error of the environment is raised to the caller, and no
    # JAX call of this thread can start a backend the settings would have ruled out.
    _prepare()
    import atexit

    _opener = threading.Thread(target=_open_ignoring_errors, name="tpu-train-open-backend",
                               daemon=True)
    _opener.start()
    # An early exit waits for the backend rather than tearing JAX down under the thread
    # (handlers run last-registered first: before JAX's own clean-up).
    atexit.register(_wait_for_opener)


def _open_ignoring_errors() -> None:
    try:
        devices()
    except Exception:  # noqa: BLE001 - the caller's own platform()/devices() raises it
        pass


def _wait_for_opener() -> None:
    opener = _opener
    if opener is not None and opener is not threading.current_thread():
        opener.join()


def _raise_deferred_error() -> None:
    # One deferred by ``import tpu_train`` after a backend had started opening early (which
    # found none) is still the first device use's to raise.
    if _environment_errors:
        raise _environment_errors[0]


def opening() -> bool:
    """Is the backend being opened on its thread (:func:`open_in_background`) right now?"""
    return _opener is not None and _opener.is_alive()


def exit_without_waiting(status: int, last_line: str) -> NoReturn:
    """Write ``last_line`` to stderr and end the process now with exit ``status``, not waiting
    for a backend still opening on its thread (a process whose own code found an error needs
    no device, and a TPU takes seconds to open); the operating system releases a chip being
    opened, as at any exit. What was held back of stderr meanwhile (the native start-up output
    of the open given up) is dropped, as for a backend that fails to open. ``os._exit``: no
    ``atexit`` handlers, so only for a process that is the command line itself."""
    held = _held_stderr
    if held is not None:
        held.give_back()
    with contextlib.suppress(OSError, ValueError):
        print(last_line, file=sys.stderr, flush=True)
        sys.stdout.flush()
    logging.shutdown()
    os._exit(status)


def platform() -> str:
    """The PJRT platform this process uses: ``"tpu"``, ``"cuda"`` or ``"cpu"`` (chosen once,
    by :func:`_choose_once`)."""
    _wait_for_opener()
    _raise_deferred_error()
    chosen = _choose_once()
    _print_notes()
    return chosen


@functools.lru_cache(maxsize=None)
def _choose_once() -> str:
    """:func:`platform`'s choice, made once (a backend opened in the background makes it on
    its thread).

    The host malloc settings the CPU client needs (:mod:`tpu_train.device.host_memory`) are
    applied before JAX creates its backends and its threads where the CPU may be chosen (never
    on a host with TPU chips), and undone when the platform chosen is another one."""
    jax, requested, evidence = _prepare()
    chosen = None
    try:
        with _native_start_up_output() as native_output:
            chosen = choose_platform(jax, requested, evidence)
        sys.stderr.write(native_output.text)
    finally:
        if chosen != "cpu":
            host_memory.restore_defaults()
    if chosen == "cpu" and requested is None and tpu_host.libtpu_installed():
        _notes.append(f"tpu_train: libtpu is installed but this host has no TPU chips: running "
                      f"on the CPU ({PLATFORM_ENV}=cpu says so and silences this line)")
    for listener in _platform_listeners:
        listener(chosen)
    return chosen


# Called with the platform once it is chosen: policies that differ per platform but must be
# settled before the first device use (strict eager mode's recording, device/lazy.py).
_platform_listeners: list = []


def on_platform_chosen(listener) -> None:
    """``listener(platform)`` when the platform is chosen, at once if it is already. It runs
    inside the choice (on the thread that makes it): it must not ask for the platform."""
    if _choose_once.cache_info().currsize:
        listener(_choose_once())
    else:
        _platform_listeners.append(listener)


# Lines for the user from the platform choice, printed by the first device use of a thread
# other than the opener's: a command that stops on a configuration error while its backend
# opens early says the error alone.
_notes: list[str] = []


def _print_notes() -> None:
    if threading.current_thread() is _opener:
        return
    while True:
        try:
            note = _notes.pop(0)
        except IndexError:  # none left (or another thread printed the last one)
            return
        print(note, file=sys.stderr)


@functools.lru_cache(maxsize=None)
def _prepare() -> tuple:
    """What must be settled before any backend starts, cheaply: the environment's errors
    raised (a bad ``TPU_TRAIN_PLATFORM`` or cache setting), JAX configured, the backends it
    may start narrowed to the CPU where only the CPU is wanted, the host malloc settings.
    Returns (jax, the requested platform or None, the evidence of TPU chips)."""
    if _environment_errors:
        raise _environment_errors[0]
    jax = _jax()
    from tpu_train.device import compilation_cache

    on_platform_chosen(compilation_cache.follow_platform)  # which programs are worth keeping
    requested = requested_platform()
    evidence = tpu_host.tpu_evidence() if requested is None else []
    if _only_cpu_is_wanted(jax, requested, evidence):
        # Keeps JAX from loading libtpu, which on a host without chips prints pages of
        # start-up errors, and which must not touch chips the user chose not to use.
        jax.config.update("jax_platforms", "cpu")
    if cpu_malloc_settings_wanted(requested, evidence):
        host_memory.keep_freed_memory()
    return jax, requested, evidence


def cpu_malloc_settings_wanted(requested: str | None, tpu_evidence: list[str]) -> bool:
    """Should the CPU client's malloc settings be applied before the backends start? Where the
    CPU is asked for, or may be chosen, and never on a host with TPU chips: starting the TPU
    backend starts libtpu's compiler workers, and a thread keeps the arena it first allocates
    from, so under the one-arena setting they would all contend for one lock for the rest of
    the process (on a v5e host the same JAX step compiled in 28 s instead of 9, docs/compile.md)."""
    return requested == "cpu" or (requested is None and not tpu_evidence)


class _CapturedText:
    text = ""


class _HeldStderr:
    """File descriptor 2 pointed at a temporary file while a backend starts, given back once:
    by the start-up when it ends, or sooner by :func:`exit_without_waiting` (another thread)."""

    def __init__(self, saved: int, sink) -> None:
        self._lock = threading.Lock()
        self._saved, self._sink = saved, sink

    def give_back(self) -> str:
        """Point fd 2 at the process's stderr again; what was written meanwhile ("" after the
        first call)."""
        with self._lock:
            if self._saved is None:
                return ""
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(self._saved, 2)
            os.close(self._saved)
            self._saved = None
            self._sink.seek(0)
            return self._sink.read().decode(errors="replace")


# The stderr held back while a backend starts (_native_start_up_output), if any.
_held_stderr: _HeldStderr | None = None


@contextlib.contextmanager
def _native_start_up_output():
    """Holds back what native code (libtpu, a GPU plugin) writes to the process's stderr while
    JAX starts its backends. A backend that fails to start prints pages of start-up errors
    there before JAX raises; the platform error then says the cause in one line, and the
    pages are dropped. When start-up succeeds the caller passes ``.text`` on unchanged."""
    global _held_stderr
    captured = _CapturedText()
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable file descriptor 2 (an embedded interpreter)
        yield captured
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        held = _held_stderr = _HeldStderr(saved, sink)
        try:
            yield captured
        finally:
            captured.text = held.give_back()
            _held_stderr = None


# What ``import jax`` itself puts into an unset ``jax_platforms`` on a host with TPU chips and
# libtpu (jax._src.cloud_tpu_init): JAX's default there, not a choice of the user's.
_CLOUD_TPU_DEFAULT_PLATFORMS = "tpu,cpu"


def _jax_platforms(jax, environ=os.environ) -> str:
    """The user's own choice of JAX backends (``JAX_PLATFORMS``, or ``jax_platforms`` set in
    JAX's config), or ``""``. On a TPU host ``import jax`` fills an unset ``jax_platforms`` with
    ``"tpu,cpu"``; taken for the user's choice, that would make a process that asks for the
    cpu platform start the TPU backend too, which fails on a chip another process holds."""
    chosen = (getattr(jax.config, "jax_platforms", None) or "").strip()
    if (chosen == _CLOUD_TPU_DEFAULT_PLATFORMS and not environ.get("JAX_PLATFORMS", "").strip()
            and _jax_set_its_tpu_default(jax)):
        return ""
    return chosen


def _jax_set_its_tpu_default(jax) -> bool:
    """Did ``import jax`` find TPU chips and libtpu (and so fill in ``jax_platforms`` itself)?"""
    try:
        from jax._src import cloud_tpu_init
    except ImportError:  # a JAX without the module: it sets no default of its own
        return False
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def _only_cpu_is_wanted(jax, requested: str | None, evidence: list[str]) -> bool:
    if _jax_platforms(jax):
        return False  # the user's own choice of JAX backends stands
    if requested == "cpu":
        return True
    # Chips JAX itself found (it then filled in "tpu,cpu") count like the evidence we found.
    return (requested is None and not evidence and not tpu_host.gpu_visible()
            and not _jax_set_its_tpu_default(jax))


def choose_platform(jax, requested: str | None, tpu_evidence: list[str]) -> str:
    """The platform to use, given JAX, ``TPU_TRAIN_PLATFORM`` and what says this host has TPU
    chips (:func:`tpu_host.tpu_evidence`)."""
    if requested:
        if not _available(jax, requested):
            raise PlatformError(
                f"{PLATFORM_ENV}={requested} but JAX finds no {requested} devices "
                f"(installed jax {jax.__version__})"
                f"{_why_not(jax, requested) or '; install the matching jax plugin'}, "
                f"or unset {PLATFORM_ENV}")
        return requested
    if tpu_evidence and _tpu_wanted_by_jax(jax) and not _available(jax, "tpu"):
        raise PlatformError(
            f"this host has TPU chips ({'; '.join(tpu_evidence)}) but JAX cannot use them"
            f"{_why_not(jax, 'tpu')}, or set {PLATFORM_ENV}=cpu to run on the host CPU")
    for name in _PREFERENCE:
        if _available(jax, name):
            return name
    raise PlatformError("JAX reports no devices at all")


def natural_buffers(platform_name: str) -> bool:
    """Should whole-tensor buffers keep their tensors' shapes on this platform (True), or be
    flat (False)?

    Flat on the CPU client: its arrays are plain row-major memory, so a reshape costs
    nothing, and the flat buffers the eager ops read are what they expect. Shaped elsewhere:
    a TPU tiles a 2-D array in (8, 128) blocks and a 1-D one in 1-D blocks, so every
    flat <-> 2-D reshape is a copy; a tensor read whole by a compiled program (a parameter,
    its optimizer state, a batch) should already have its shape."""
    return platform_name != "cpu"


def _tpu_wanted_by_jax(jax) -> bool:
    """False when the user's JAX_PLATFORMS leaves the TPU out: that is their choice."""
    chosen = _jax_platforms(jax)
    return not chosen or "tpu" in chosen.split(",")


def _why_not(jax, name: str) -> str:
    """Why JAX has no ``name`` backend and what to do, as a clause of one line."""
    if name == "cpu":  # JAX always has one, unless another backend it was told to start failed
        return _first_line_of_error(jax, name)
    if name != "tpu":
        return ""
    if not tpu_host.libtpu_installed():
        return f": libtpu is not installed; install it with {TPU_INSTALL}"
    reason = "its TPU backend did not start"
    try:
        jax.devices("tpu")
    except RuntimeError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = lines[0][:300] if lines else reason
    return (f": {reason}; if another process holds the chips, stop it "
            f"(sudo lsof -w /dev/accel* /dev/vfio/* names it)")


def _first_line_of_error(jax, name: str) -> str:
    try:
        jax.devices(name)
    except RuntimeError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return f": {lines[0][:300]}" if lines else ""
    return ""


# Errors in the process's environment found while ``import tpu_train`` registers the device
# (a misspelt TPU_TRAIN_EAGER_MODE): raised at first device use, like a bad platform, so that
# the import succeeds and the command line can report them as one line.
_environment_errors: list = []


def defer_environment_error(error: Exception) -> None:
    _environment_errors.append(error)


def devices() -> tuple:
    """The local JAX devices of the chosen platform; ``tpu:i`` is ``devices()[i]``."""
    _wait_for_opener()
    _raise_deferred_error()
    found = _local_devices()
    _print_notes()
    return found


@functools.lru_cache(maxsize=None)
def _local_devices() -> tuple:
    _raise_deferred_error()
    jax = _jax()
    for alias in _JAX_ALIASES[platform()]:
        try:
            found = jax.local_devices(backend=alias)
        except RuntimeError:
            continue
        if found:
            return tuple(found)
    raise PlatformError(f"no local {platform()} devices")


def devices_enumerated() -> bool:
    """Has this process asked for its devices yet (so JAX's backends exist)?"""
    return _local_devices.cache_info().currsize > 0


def device_count() -> int:
    return len(devices())


def platform_present() -> bool:
    """Would this process find a platform for the tpu device? Judged without starting a
    backend, which on a TPU host opens the chip and holds it against every other process (a
    launcher that asked would lock its own workers out): the CPU client is always there; a
    requested ``tpu`` needs the host's evidence of chips and libtpu, a requested ``cuda`` a
    GPU's device file; an invalid ``TPU_TRAIN_PLATFORM`` says no. A backend that then fails
    to open is reported by the first device use."""
    try:
        requested = requested_platform()
    except PlatformError:
        return False
    if requested == "tpu":
        return bool(tpu_host.tpu_evidence()) and tpu_host.libtpu_installed()
    if requested == "cuda":
        return tpu_host.gpu_visible()
    return True


def jax_device(index: int | None):
    """The JAX device behind ``tpu:index``; a clear error when the index is out of range."""
    found = devices()
    index = 0 if index is None else index
    if not 0 <= index < len(found):
        raise IndexError(
            f"tpu device index {index} is out of range: this process has {len(found)} "
            f"{platform()} device(s), tpu:0..tpu:{len(found) - 1}")
    return found[index]


def device_kind(index: int = 0) -> str:
    return jax_device(index).device_kind


def runtime_info() -> dict:
    """What this process runs on: platform, devices and versions (for logs and bug reports)."""
    import jax
    import jaxlib
    import torch

    found = devices()
    return {
        "platform": platform(),
        "device_count": len(found),
        "device_kind": found[0].device_kind if found else None,
        "devices": [str(d) for d in found],
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "torch": torch.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": _platform.python_version(),
    }


# XLA's CPU compiler keeps a copy of each donated parameter that a step both reads and then
# overwrites, unless its copy insertion runs the region-based analysis (off by default on CPU;
# XLA's own host-offloading programs turn it on), which proves the update comes after every
# read. The W1 training step then stops copying its 16.8 M parameters each step
# (docs/compile.md). Only the CPU client has the option; other platforms get XLA's defaults.
_CPU_COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def compiler_options(platform_name: str) -> dict:
    """XLA options for a training-step program on ``platform_name`` (a JAX device platform)."""
    return dict(_CPU_COMPILER_OPTIONS) if platform_name == "cpu" else {}


# A program of one op (eager mode's op executables, storage reads, writes and fills) runs for
# microseconds on a TPU next to ~0.2 ms of host time per call, and is compiled on its first
# use, in the user's loop. XLA's least optimization effort compiles such programs ~5x faster
# for a v5e (W1's first eager step's 68: docs/compile.md, "XLA's optimization effort"); what
# it gives up is what a whole training step's fusions need, not one op's. Eager mode's recorded
# regions get it too (device/lazy.py); compiled steps, validation and decoding keep XLA's default.
_LEAST_EFFORT = {"exec_time_optimization_effort": -1.0}
EFFORT_ENV = "JAX_EXEC_TIME_OPTIMIZATION_EFFORT"


def op_program_options() -> dict | None:
    """XLA options for a one-op program (``jax.jit(..., compiler_options=...)``): the least
    optimization effort, unless the user chose an effort for every program through JAX."""
    import jax

    if os.environ.get(EFFORT_ENV) or jax.config.jax_exec_time_optimization_effort != 0.0:
        return None
    return _LEAST_EFFORT
