"""A step too large for its chip's memory, as XLA reports it when it compiles the program.

XLA's TPU compiler assigns every buffer of a program before it generates code; when they do
not fit in HBM it fails the compile with a ``RESOURCE_EXHAUSTED`` status ("Ran out of memory in
memory space hbm. Used 16.10G of 15.75G hbm. ...", followed by a table of the largest
buffers), which JAX raises as a ``JaxRuntimeError`` with its traceback. Here that becomes
:class:`ProgramOutOfMemoryError`: the bytes the program needs and the chip has, parsed from
XLA's message, for a one-line report (the trainer adds the settings that would fit).
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# "Used 16.10G of 15.75G hbm." (XLA:TPU); sizes are binary units with one letter.
_USED = re.compile(r"Used ([\d.]+)([KMGT]?)B? of ([\d.]+)([KMGT]?)B? (\w+)")


class ProgramOutOfMemoryError(MemoryError):
    """The compiled step does not fit in its device's memory.

    ``needed_bytes`` / ``capacity_bytes``: XLA's figures (None where its message has none);
    ``memory``: the memory space XLA names (``hbm``); ``detail``: XLA's first line."""

    def __init__(self, needed_bytes: int | None, capacity_bytes: int | None, memory: str,
                 detail: str):
        self.needed_bytes, self.capacity_bytes = needed_bytes, capacity_bytes
        self.memory, self.detail = memory, detail
        super().__init__(self.summary())

    def summary(self) -> str:
        if self.needed_bytes is None or self.capacity_bytes is None:
            return f"the compiled train step does not fit in device memory ({self.detail})"
        return (f"the compiled train step needs {gib(self.needed_bytes)} of "
                f"{self.memory.upper()} per chip, which has {gib(self.capacity_bytes)}")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def out_of_memory(error: BaseException) -> ProgramOutOfMemoryError | None:
    """The :class:`ProgramOutOfMemoryError` that XLA's compile ``error`` reports, or None for
    any other error."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = lines[0] if lines else "RESOURCE_EXHAUSTED"
    found = _USED.search(text)
    if found is None:
        return ProgramOutOfMemoryError(None, None, "memory", detail)
    used, used_unit, have, have_unit, memory = found.groups()
    return ProgramOutOfMemoryError(int(float(used) * _UNITS[used_unit]),
                                   int(float(have) * _UNITS[have_unit]), memory, detail)
