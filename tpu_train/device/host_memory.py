"""glibc malloc settings for a process whose ``tpu`` device is the JAX CPU client.

The CPU client allocates every program's outputs and its scratch buffer (``preallocated
temp``: 141 MiB for the default run's train step) with ``malloc`` on its own threads, and frees
them when the arrays die. With glibc's defaults each such buffer of a compiled step comes back
from the kernel as fresh pages and is returned to it afterwards: blocks above 32 MiB are always
``mmap``-ed (the dynamic mmap threshold stops there), a worker thread's arena falls back to
``mmap`` for any block larger than its 64 MiB heaps, and freed heap tops are trimmed
(``madvise``/``brk``). Every step then page-faults its whole working set again. Measured on the
default run's compiled step (debug_tiny, 8 x 128 tokens, 2-core machine shared with other
jobs): 37,000-44,000 minor page faults and about 0.1 s of system time a step, 0.45-0.54 s a
step; with the settings below about 1,000 faults, 0.004 s of system time and 0.38-0.47 s a
step (docs/benchmarks.md, "The default run").

:func:`keep_freed_memory` therefore makes freed memory stay in the process for reuse, as a
device allocator would: one arena (the main one, which grows with ``brk`` and so holds blocks
of any size), no ``mmap`` for blocks and no trimming. The resident size then stays at the
process's high-water mark instead of following each step's allocations. It must run before
the CPU client starts its threads (a thread keeps the arena it first allocated from), so
:func:`tpu_train.device.runtime.platform` applies it before JAX creates its backends and calls
:func:`restore_defaults` when the platform chosen is not the CPU (an accelerator's host
process keeps glibc's behaviour). ``TPU_TRAIN_HOST_MALLOC=default`` leaves glibc alone.
Elsewhere than glibc (macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV = "TPU_TRAIN_HOST_MALLOC"

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

# glibc's defaults, to restore: 64 Ki mmap-ed blocks, a 128 KiB trim threshold, and
# 8 arenas per core on 64-bit machines.
_DEFAULT_MMAP_MAX = 65536
_DEFAULT_TRIM_THRESHOLD = 128 * 1024
# Trimming only past 2 GiB of free heap top (mallopt takes a C int).
_NEVER_TRIM = 2**31 - 1

_applied = False


def _mallopt():
    """glibc's ``mallopt``, or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallopt
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


def wanted() -> bool:
    """False when ``TPU_TRAIN_HOST_MALLOC=default`` asks to leave glibc's settings alone."""
    return os.environ.get(ENV, "").strip().lower() != "default"


def keep_freed_memory() -> bool:
    """One arena, no ``mmap``-ed blocks, no trimming; True when applied (glibc, not opted out)."""
    global _applied
    if not wanted():
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # The trim threshold first: from then on a freed heap top is kept.
    done = (mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
            and mallopt(_M_MMAP_MAX, 0) == 1
            and mallopt(_M_ARENA_MAX, 1) == 1)
    _applied = _applied or done
    return done


def allow_thread_arenas() -> None:
    """glibc's default arena count again, the rest of :func:`keep_freed_memory` kept: threads
    that start from now on allocate from arenas of their own. For libtpu loaded into a CPU-client
    process to compile for a TPU that is not there: its compiler workers, one per host core,
    would otherwise all contend for the main arena's lock (on a 13-core v5e host a JAX step
    compiled compile-only under the one-arena setting took 26.5 s, against 9.3 s without it).
    The CPU client's threads keep the arena they already have."""
    if not _applied:
        return
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, 8 * (os.cpu_count() or 1))


def restore_defaults() -> None:
    """glibc's default limits again (after :func:`keep_freed_memory`; a no-op otherwise)."""
    global _applied
    if not _applied:
        return
    mallopt = _mallopt()
    if mallopt is None:
        return
    mallopt(_M_ARENA_MAX, 8 * (os.cpu_count() or 1))
    mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
    mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
    _applied = False


def applied() -> bool:
    """Are the settings of :func:`keep_freed_memory` in force?"""
    return _applied
