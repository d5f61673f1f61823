"""``torch.tpu``: the device module PyTorch looks up for the ``tpu`` device type.

Mirrors the parts of ``torch.cuda`` that PyTorch itself and common training code call:
availability and device selection, synchronization, RNG, memory statistics, and
Stream/Event objects. PJRT orders work per device by itself, so a stream here is an ordering
token: ``synchronize`` on it waits for the device's outstanding work; that is what FSDP2 and
DDP need from it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import jax
import torch

from tpu_train.device import lazy as _lazy
from tpu_train.device import pinned as _pinned
from tpu_train.device import rng as _rng
from tpu_train.device import runtime
from tpu_train.device import storage as _storage

_local = threading.local()


def is_available() -> bool:
    """Is there a device for ``tpu`` tensors? Until this process first uses its devices the
    answer opens no backend (:func:`runtime.platform_present`), as ``torch.cuda.is_available``
    creates no CUDA context: asking must not take a TPU chip from the processes that will
    use it."""
    if not runtime.devices_enumerated():
        return runtime.platform_present()
    try:
        return runtime.device_count() > 0
    except runtime.PlatformError:
        return False


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def device_count() -> int:
    return runtime.device_count()


def current_device() -> int:
    return getattr(_local, "device", 0)


def _index(device=None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "tpu":
        raise ValueError(f"expected a tpu device, got {device}")
    return current_device() if device.index is None else device.index


def set_device(device) -> None:
    index = _index(device)
    runtime.jax_device(index)  # range check
    _local.device = index


class device:  # noqa: N801 - torch.cuda.device's name
    """Context manager that changes the current tpu device."""

    def __init__(self, device):
        self.index = _index(device)
        self.previous = None

    def __enter__(self):
        self.previous = current_device()
        set_device(self.index)

    def __exit__(self, *exc):
        set_device(self.previous)
        return False


def get_device_name(device=None) -> str:
    return runtime.device_kind(_index(device))


def get_device_properties(device=None):
    jax_device = runtime.jax_device(_index(device))
    stats = jax_device.memory_stats() or {}
    return _DeviceProperties(jax_device.device_kind, stats.get("bytes_limit", 0), runtime.platform())


class _DeviceProperties:
    def __init__(self, name, total_memory, platform):
        self.name, self.total_memory, self.platform = name, total_memory, platform

    def __repr__(self):
        return f"_TpuDeviceProperties(name={self.name!r}, total_memory={self.total_memory}, platform={self.platform!r})"


def synchronize(device=None) -> None:
    """Wait for all work queued on the device (a small computation forces the queue); in
    fused eager mode, run what was recorded first."""
    jax_device = runtime.jax_device(_index(device))
    _lazy.flush_all()
    _pinned.wait_for_transfers()  # asynchronous copies from pinned memory
    jax.device_put(0, jax_device).block_until_ready()
    jax.effects_barrier()


# -- RNG -----------------------------------------------------------------------------------------


def manual_seed(seed: int) -> None:
    _rng.manual_seed(int(seed), current_device())


def manual_seed_all(seed: int) -> None:
    _rng.manual_seed_all(int(seed))


def seed() -> None:
    manual_seed(int(time.time_ns()) & 0xFFFFFFFF)


def seed_all() -> None:
    manual_seed_all(int(time.time_ns()) & 0xFFFFFFFF)


def initial_seed() -> int:
    return _rng.initial_seed(current_device())


def get_rng_state(device="tpu") -> torch.Tensor:
    return _rng.get_state(_index(device))


def set_rng_state(new_state: torch.Tensor, device="tpu") -> None:
    _rng.set_state(new_state, _index(device))


def get_rng_state_all() -> list:
    return [_rng.get_state(i) for i in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for index, state in enumerate(new_states):
        _rng.set_state(state, index)


# -- memory --------------------------------------------------------------------------------------


def memory_stats(device=None) -> dict:
    """Allocated bytes as PyTorch means them, the memory the device's tensors occupy: the live
    and peak bytes of tpu_train's own storages, on every platform (the peak resets as
    ``reset_peak_memory_stats`` promises). Where the backend reports PJRT's allocator statistics
    (TPU, GPU) they come along under their own names, and its ``bytes_in_use`` (which also holds
    the loaded executables and the padding of the device's tiled layouts) is the reserved
    figure; elsewhere every reserved byte is an allocated one (no caching allocator)."""
    index = _index(device)
    current, peak = _storage.allocated_bytes(index), _storage.peak_allocated_bytes(index)
    pjrt = runtime.jax_device(index).memory_stats() or {}
    reserved = max(current, pjrt.get("bytes_in_use", 0))
    reserved_peak = max(peak, pjrt.get("peak_bytes_in_use", 0))
    return {**pjrt, "source": "pjrt" if pjrt else "tpu_train",
            "allocated_bytes.all.current": current, "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": reserved, "reserved_bytes.all.peak": reserved_peak}


def memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def reset_peak_memory_stats(device=None) -> None:
    _storage.reset_peak(_index(device))


def reset_accumulated_memory_stats(device=None) -> None:
    """Nothing to reset: no allocation/free counters are kept (only live and peak bytes)."""
    _index(device)


def mem_get_info(device=None) -> tuple:
    """(free, total) bytes of the device's memory. The CPU client's device memory is host
    memory, so there it is the host's available and physical memory."""
    stats = runtime.jax_device(_index(device)).memory_stats()
    if stats and stats.get("bytes_limit"):
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), stats["bytes_limit"]
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def empty_cache() -> None:
    pass


# -- streams and events --------------------------------------------------------------------------


class Stream:
    """An ordering token on a device (PJRT orders a device's work itself)."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device_index = _index(device)
        self.device = torch.device("tpu", self.device_index)
        self.priority = priority

    def wait_event(self, event) -> None:
        if event is not None:
            event.synchronize()

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        synchronize(self.device_index)

    def __eq__(self, other):
        return isinstance(other, Stream) and other.device_index == self.device_index

    def __hash__(self):
        return hash(("tpu-stream", self.device_index))


class Event:
    """Marks a point in a device's queue; ``synchronize`` waits for the work before it."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self.device_index = None
        self.time = None

    def record(self, stream=None) -> None:
        self.device_index = (stream or current_stream()).device_index
        self.time = time.perf_counter()

    def wait(self, stream=None) -> None:
        self.synchronize()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if self.device_index is not None:
            synchronize(self.device_index)

    def elapsed_time(self, end_event) -> float:
        self.synchronize()
        end_event.synchronize()
        return (end_event.time - self.time) * 1000.0


_streams: dict = {}


def default_stream(device=None) -> Stream:
    index = _index(device)
    if index not in _streams:
        _streams[index] = Stream(index)
    return _streams[index]


def current_stream(device=None) -> Stream:
    return getattr(_local, "stream", None) or default_stream(device)


def set_stream(stream: Stream) -> None:
    _local.stream = stream


@contextlib.contextmanager
def stream(stream_: Stream | None):
    previous = getattr(_local, "stream", None)
    if stream_ is not None:
        _local.stream = stream_
    try:
        yield stream_
    finally:
        _local.stream = previous


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list:
    # torch.autocast("tpu") calls this on entering every region: the first call installs the
    # AutocastPrivateUse1 kernels (without them every op under autocast fails), so plain
    # `import tpu_train` does not pay for them.
    from tpu_train.device import autocast

    autocast.register()
    return [torch.bfloat16, torch.float16]


def _is_in_bad_fork() -> bool:
    return False


def _follow_float32_matmul_precision() -> None:
    """Make ``torch.set_float32_matmul_precision(p)`` also set the tpu matmul precision.

    The tpu dots read ``tpu_train.ops.matmul``'s process-wide level; following torch's setter
    (instead of reading ``torch.get_float32_matmul_precision()`` in every dot) costs nothing per
    op, and compiled steps key their cache on the level, so they recompile when it changes.
    A level set before ``import tpu_train`` is taken over here.
    """
    from tpu_train.ops import matmul

    original = torch.set_float32_matmul_precision
    if getattr(original, "__tpu_train__", False):
        return

    def set_float32_matmul_precision(precision: str) -> None:
        original(precision)
        matmul.set_matmul_precision(precision)

    set_float32_matmul_precision.__doc__ = original.__doc__
    set_float32_matmul_precision.__tpu_train__ = True
    set_float32_matmul_precision.__wrapped__ = original
    torch.set_float32_matmul_precision = set_float32_matmul_precision
    if torch.get_float32_matmul_precision() != matmul.get_matmul_precision():
        matmul.set_matmul_precision(torch.get_float32_matmul_precision())


_follow_float32_matmul_precision()
