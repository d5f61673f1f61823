"""The PJRT client, reached through JAX: platform choice and device enumeration.

``TPU_TRAIN_PLATFORM`` picks the PJRT platform (``tpu``, ``cuda`` or ``cpu``); unset, the best
one present wins (tpu, then cuda, then cpu). Every other module asks this one for devices, so
the choice is made once per process. The same first call configures JAX's persistent
compilation cache (``TPU_TRAIN_CACHE_DIR``, :mod:`tpu_train.device.compilation_cache`), so it is
in place before anything is compiled.
"""

from __future__ import annotations

import functools
import os
import platform as _platform

from tpu_train.device import host_memory

PLATFORM_ENV = "TPU_TRAIN_PLATFORM"
_PREFERENCE = ("tpu", "cuda", "cpu")
# JAX names the CUDA plugin's platform "gpu" in some places and "cuda" in others.
_JAX_ALIASES = {"cuda": ("cuda", "gpu"), "tpu": ("tpu",), "cpu": ("cpu",)}


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
    for alias in _JAX_ALIASES[name]:
        try:
            if jax.devices(alias):
                return True
        except RuntimeError:
            continue
    return False


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


@functools.lru_cache(maxsize=None)
def platform() -> str:
    """The PJRT platform this process uses: ``"tpu"``, ``"cuda"`` or ``"cpu"``.

    The host malloc settings the CPU client needs (:mod:`tpu_train.device.host_memory`) are
    applied before JAX creates its backends and its threads, and undone when the platform
    chosen is another one."""
    jax = _jax()
    requested = requested_platform()
    if requested == "cpu" and not jax.config.jax_platforms:
        # Only the CPU client is wanted: JAX then starts no other backend. With libtpu
        # installed on a host without a chip (the ``tpu`` extra, for compiling for TPUs),
        # starting the TPU backend to find no chip writes five lines of libtpu warnings.
        jax.config.update("jax_platforms", "cpu")
    if requested in (None, "cpu"):
        host_memory.keep_freed_memory()
    chosen = None
    try:
        chosen = _choose(jax, requested)
    finally:
        if chosen != "cpu":
            host_memory.restore_defaults()
    return chosen


def _choose(jax, requested: str | None) -> str:
    if requested:
        if not _available(jax, requested):
            raise PlatformError(
                f"{PLATFORM_ENV}={requested} but JAX finds no {requested} devices "
                f"(installed jax {jax.__version__}); install the matching jax plugin "
                f"or unset {PLATFORM_ENV}")
        return requested
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


# Errors in the process's environment found while ``import tpu_train`` registers the device
# (a misspelt TPU_TRAIN_EAGER_MODE): raised at first device use, like a bad platform, so that
# the import succeeds and the command line can report them as one line.
_environment_errors: list = []


def defer_environment_error(error: Exception) -> None:
    _environment_errors.append(error)


@functools.lru_cache(maxsize=None)
def devices() -> tuple:
    """The local JAX devices of the chosen platform; ``tpu:i`` is ``devices()[i]``."""
    if _environment_errors:
        raise _environment_errors[0]
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
    return devices.cache_info().currsize > 0


def device_count() -> int:
    return len(devices())


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
