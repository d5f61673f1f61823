"""The TPU compiler's own total of a program's HBM, read from libtpu's log.

``memory_analysis()`` of a TPU executable adds the compiler's fragmentation figure to its
temporaries although the temporaries it reports already hold it: for Llama-3.1-70B on
``v5p:4x4x8`` it says 22.30 GiB of temporaries where the compiler's log has "HLO temp 13.27G
(... 68.0% fragmentation (9.02G))", and a per-chip peak of 28.52 GiB where the log's total is
"Total hbm usage >= 20.15G" (program, arguments, reserved memory and code overlays; docs/compile.md).
That total is written at the end of code generation, as an INFO line of libtpu's log: a
process that compiles with :func:`log_env` finds it in its log directory afterwards
(:func:`total_hbm_bytes`).
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["log_env", "parse_total_hbm", "total_hbm_bytes"]

# libtpu's INFO log of one process, in TPU_LOG_DIR.
LOG_NAME = "tpu_driver.INFO"
_TOTAL = re.compile(r"Total hbm usage >= ([0-9.]+)([KMGT]?)B?:")
_RESERVED = re.compile(r"^\s*reserved\s+([0-9.]+)([KMGT]?)B?\s*$", re.MULTILINE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def log_env(directory: str, environ: dict) -> dict:
    """``environ`` with libtpu writing its INFO log to ``directory`` as lines come (its log
    buffer otherwise holds them up to 30 s, and a short compile's process may end first)."""
    env = dict(environ)
    env["TPU_LOG_DIR"] = directory
    env["TPU_MIN_LOG_LEVEL"] = "0"
    env.setdefault("TPU_STDERR_LOG_LEVEL", "2")  # the INFO lines to the file, not to stderr
    flags = env.get("LIBTPU_INIT_ARGS", "").split()
    if not any(f.startswith("--logbuflevel") for f in flags):
        flags.append("--logbuflevel=-1")
    env["LIBTPU_INIT_ARGS"] = " ".join(flags)
    return env


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


def parse_total_hbm(text: str) -> dict[str, int] | None:
    """The last "Total hbm usage >= N" block of a libtpu log's text, in bytes:
    ``{"total": N, "reserved": R}`` (R: what the runtime keeps for itself, about 260 MB on a
    v5e whatever the program; the rest is the program, its code included, and its
    arguments), or None. The units are binary (a v5e's 15.75 GiB of HBM is "15.75G" in the
    same log), two decimals."""
    found = list(_TOTAL.finditer(text))
    if not found:
        return None
    last = found[-1]
    block = text[last.end():].split("\n\n", 1)[0]
    reserved = _RESERVED.search(block)
    return {"total": _bytes(*last.groups()),
            "reserved": _bytes(*reserved.groups()) if reserved else 0}


def total_hbm_bytes(directory: str) -> dict[str, int] | None:
    """:func:`parse_total_hbm` of the INFO log libtpu wrote to ``directory``, None where it
    wrote none (or no such line: another libtpu's format)."""
    path = Path(directory) / LOG_NAME
    try:
        return parse_total_hbm(path.read_text(errors="replace"))
    except OSError:
        return None
