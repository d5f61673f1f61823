"""A step too large for its chip's memory, as XLA reports it when it compiles the program.

XLA's TPU compiler assigns every buffer of a program before it generates code; when they do
not fit in HBM it fails the compile with a ``RESOURCE_EXHAUSTED`` status ("Ran out of memory
on HBM, the total memory required for HLO temporaries (22.93G) exceeds available HBM
(15.75G)"), which JAX raises as a ``JaxRuntimeError`` with its traceback. Here that becomes
:class:`ProgramOutOfMemoryError`: the bytes the program needs and the chip has, parsed from
XLA's message, for a one-line report (the trainer adds the settings that would fit).
"""

from __future__ import annotations

import functools
import re

import jax
import numpy

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = r"([\d.]+)([KMGT]?)B?"
# XLA:TPU's compile-time forms: "the total memory required for HLO temporaries (22.93G)
# exceeds available HBM (15.75G)" (temporaries only: the arguments are on top) and "Used
# 16.10G of 15.75G hbm" (everything).
_TEMPORARIES = re.compile(rf"required for HLO temporaries \({_SIZE}\) exceeds available "
                          rf"(\w+) \({_SIZE}\)")
_USED = re.compile(rf"Used {_SIZE} of {_SIZE} (\w+)")


class ProgramOutOfMemoryError(MemoryError):
    """The compiled step does not fit in its device's memory.

    ``needed_bytes`` / ``capacity_bytes``: per device, from XLA's figures (None where its
    message has none), the arguments (parameters, optimizer state, batch) included;
    ``memory``: the memory space XLA names (``HBM``); ``detail``: XLA's first line."""

    def __init__(self, needed_bytes: int | None, capacity_bytes: int | None, memory: str,
                 detail: str, argument_bytes: int = 0):
        self.needed_bytes, self.capacity_bytes = needed_bytes, capacity_bytes
        self.memory, self.detail, self.argument_bytes = memory, detail, argument_bytes
        super().__init__(self.summary())

    def summary(self) -> str:
        if self.needed_bytes is None or self.capacity_bytes is None:
            return f"the compiled train step does not fit in device memory ({self.detail})"
        parts = (f" ({gib(self.needed_bytes - self.argument_bytes)} of temporaries, "
                 f"{gib(self.argument_bytes)} of parameters, optimizer state and batch)"
                 if self.argument_bytes else "")
        return (f"the compiled train step needs {gib(self.needed_bytes)} of "
                f"{self.memory.upper()} per chip{parts}, which has {gib(self.capacity_bytes)}")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


def out_of_memory(error: BaseException, argument_bytes: int = 0
                  ) -> ProgramOutOfMemoryError | None:
    """The :class:`ProgramOutOfMemoryError` that XLA's compile ``error`` reports, or None for
    any other error. ``argument_bytes``: what the program's inputs take per device, added
    where XLA counts the temporaries only."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = lines[0] if lines else "RESOURCE_EXHAUSTED"
    found = _TEMPORARIES.search(text)
    if found is not None:
        temporaries, unit, memory, have, have_unit = found.groups()
        return ProgramOutOfMemoryError(_bytes(temporaries, unit) + argument_bytes,
                                       _bytes(have, have_unit), memory, detail, argument_bytes)
    found = _USED.search(text)
    if found is not None:
        used, used_unit, have, have_unit, memory = found.groups()
        return ProgramOutOfMemoryError(_bytes(used, used_unit), _bytes(have, have_unit),
                                       memory, detail)
    return ProgramOutOfMemoryError(None, None, "memory", detail)


def compiled(lowered, stages, compiler_options, in_shardings=None):
    """XLA's executable of ``lowered``; a program too large for the device's memory is a
    :class:`ProgramOutOfMemoryError` (one line)."""
    try:
        return stages.time("compile", functools.partial(lowered.compile,
                                                        compiler_options=compiler_options))
    except Exception as error:  # noqa: BLE001 - only XLA's RESOURCE_EXHAUSTED is replaced
        found = out_of_memory(error, argument_bytes(lowered, in_shardings))
        if found is None:
            raise
        raise found from None


def argument_bytes(lowered, in_shardings) -> int:
    """Bytes of the program's arguments on one device (each as its sharding splits it)."""
    args = jax.tree_util.tree_leaves(lowered.args_info)
    shardings = jax.tree_util.tree_leaves(
        in_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)) \
        if in_shardings is not None else []
    if len(shardings) != len(args):
        shardings = [None] * len(args)
    total = 0
    for arg, sharding in zip(args, shardings):
        shape = tuple(arg.shape)
        if isinstance(sharding, jax.sharding.Sharding):
            shape = sharding.shard_shape(shape)
        total += int(numpy.prod(shape, dtype=numpy.int64)) * numpy.dtype(arg.dtype).itemsize
    return total
