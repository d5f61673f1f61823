"""Compiling for a TPU that is not here: named TPU topologies as compile-only devices.

XLA's TPU compiler ships in libtpu (``pip install tpu_train[tpu]``) and runs on any Linux
x86-64 host, chip or not. ``jax.experimental.topologies`` turns a topology name into devices that
programs can be lowered and compiled for, but never run on; their compiled programs carry the
TPU compiler's memory statistics and cost analysis. MaxText's ``train_compile.py`` checks a pod
configuration the same way before renting it.

    from tpu_train.compile import lower_train_step
    from tpu_train.compile.targets import resolve_target

    target = resolve_target("v5e:2x2")          # 4 v5e chips; "v5e" alone is one chip
    two = resolve_target("v5e:4x4", num_slices=2)  # 2 slices of 16 chips, joined by DCN
    mesh = target.mesh((4,), ("data",))         # a jax.sharding.Mesh over them
    program = lower_train_step(model, opt, loss_fn, batch, target="v5e")   # one chip
    program.analysis()                          # the TPU compiler's bytes and FLOPs

A name is ``<generation>[:<topology>]``: generations ``v4``, ``v5e``, ``v5p``, ``v6e`` (the
aliases ``v5litepod``/``v5lite`` and ``trillium`` are accepted), topologies ``AxB`` (v5e,
v6e) or ``AxBxC`` (v4, v5p), in chips; without one, a single chip. A bad name, a topology
libtpu rejects, or a missing libtpu is a :class:`TargetError` with one line saying what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
from typing import Any

from tpu_train.device import host_memory

__all__ = ["GENERATIONS", "Target", "TargetError", "libtpu_available", "parse_target",
           "resolve_target", "target_of"]

# Generation -> how many dimensions its topologies have.
GENERATIONS: dict[str, int] = {"v4": 3, "v5e": 2, "v5p": 3, "v6e": 2}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "trillium": "v6e"}
# Chips one host holds along each axis, at most (libtpu's default host bounds).
_HOST_BOUNDS = (2, 2, 1)
_TOPOLOGY = re.compile(r"^\d+(x\d+)*$")


class TargetError(ValueError):
    """A TPU target that cannot be compiled for (bad name, or no libtpu)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A named TPU topology: its compile-only devices (``jax.Device``, never runnable)."""

    name: str  # canonical, e.g. "v5e:2x2"
    generation: str
    shape: tuple[int, ...]  # chips along each axis
    devices: tuple
    num_slices: int = 1  # slices joined by the data-center network (DCN)

    @property
    def num_chips(self) -> int:
        return math.prod(self.shape) * self.num_slices

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind

    def mesh(self, axis_sizes: tuple[int, ...], axis_names: tuple[str, ...]):
        """A ``jax.sharding.Mesh`` of this topology's devices with the given axes."""
        import numpy as np
        from jax.sharding import Mesh

        if math.prod(axis_sizes) != len(self.devices):
            raise TargetError(f"mesh axes {dict(zip(axis_names, axis_sizes))} hold "
                              f"{math.prod(axis_sizes)} devices, target {self.name} has "
                              f"{len(self.devices)}")
        return Mesh(np.asarray(self.devices, dtype=object).reshape(axis_sizes), axis_names)


def libtpu_available() -> bool:
    """Is XLA's TPU compiler (the ``libtpu`` package) importable?"""
    return importlib.util.find_spec("libtpu") is not None


def parse_target(name: str) -> tuple[str, tuple[int, ...]]:
    """``(generation, chips along each axis)`` of a target name, checked without libtpu."""
    usage = ("use <generation>[:<topology>], generation one of "
             f"{', '.join(GENERATIONS)}, topology like 2x2 (v5e, v6e) or 2x2x1 (v4, v5p)")
    if not isinstance(name, str) or not name.strip():
        raise TargetError(f"TPU target {name!r} is empty; {usage}")
    generation, _, topology = name.strip().lower().partition(":")
    generation = _ALIASES.get(generation, generation)
    if generation not in GENERATIONS:
        raise TargetError(f"unknown TPU generation in target {name!r}; {usage}")
    rank = GENERATIONS[generation]
    if not topology:
        return generation, (1,) * rank
    if not _TOPOLOGY.match(topology):
        raise TargetError(f"bad topology in TPU target {name!r}; {usage}")
    shape = tuple(int(d) for d in topology.split("x"))
    if len(shape) != rank or 0 in shape:
        raise TargetError(f"TPU target {name!r}: a {generation} topology has {rank} "
                          f"non-zero dimensions ({'x'.join(['2'] * rank)}, ...)")
    return generation, shape


def _quiet_chipless_libtpu() -> None:
    """Where this process runs no TPU (the platform chosen is another; with
    ``TPU_TRAIN_PLATFORM=cpu`` JAX never even starts its TPU backend), tell libtpu it is a
    single host outside any TPU VM: it then skips looking up the VM's metadata and writes no
    warnings about it, and it does not take the lock that reserves chips for one process
    (compiling only, another process compiling too, a plan's child say, is no conflict). A
    TPU VM's runtime is never affected, nor are the user's settings."""
    from tpu_train.device import runtime

    if runtime.platform() != "tpu":
        for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                           ("TPU_HOST_BOUNDS", "1,1,1"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
            os.environ.setdefault(key, value)


@functools.lru_cache(maxsize=None)
def _topology_devices(generation: str, shape: tuple[int, ...], num_slices: int = 1) -> tuple:
    from jax.experimental import topologies

    _quiet_chipless_libtpu()
    host_memory.allow_thread_arenas()  # before libtpu starts its compiler workers
    padded = shape + (1,) * (3 - len(shape))
    host = tuple(min(d, h) for d, h in zip(padded, _HOST_BOUNDS))
    name = f"{generation}:{'x'.join(map(str, shape))}"
    try:
        topology = topologies.get_topology_desc(name, "tpu", chips_per_host_bounds=host,
                                                num_slices=num_slices)
    except Exception as error:  # noqa: BLE001 - libtpu's errors are XlaRuntimeErrors
        message = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise TargetError(f"TPU target {name!r}: libtpu cannot build it ({message})") from None
    return tuple(topology.devices)


def resolve_target(name: str, num_slices: int = 1) -> Target:
    """The compile-only devices of the TPU topology ``name`` (module docstring);
    ``num_slices`` such slices joined by DCN (a multi-slice job: each device's
    ``slice_index`` says which slice it is in, and the mesh's DCN axes span them)."""
    generation, shape = parse_target(name)
    canonical = f"{generation}:{'x'.join(map(str, shape))}"
    if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
        raise TargetError(f"num_slices must be a positive int, got {num_slices!r}")
    if not libtpu_available():
        raise TargetError(f"compiling for TPU target {canonical!r} needs XLA's TPU compiler: "
                          "pip install tpu_train[tpu] (libtpu)")
    return Target(canonical, generation, shape, _topology_devices(generation, shape, num_slices),
                  num_slices)


def target_of(value: Any) -> Target:
    """A :class:`Target` from a name or a Target (for ``target=`` arguments)."""
    return value if isinstance(value, Target) else resolve_target(value)
