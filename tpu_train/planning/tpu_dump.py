"""The TPU compiler's per-chip figures, read from its dump before its code generation ends.

Most of a pod-sized step's TPU compile is code generation for each fused kernel: Llama-3.1-8B
on ``v5e:16x16`` spent 6.7 s in XLA's HLO passes, then about six minutes generating code, on
a 2-core host. A quick plan can do without the code: the FLOPs are fixed by the optimized
HLO and most of the memory by XLA's buffer assignment, and with ``xla_dump_to`` the compiler
writes both as text when its HLO passes end. :func:`dumped_figures` reads them;
:func:`report_when_dumped` lets a process that only plans report them and exit while the
compiler goes on generating code (``tpu-train plan ... plan.fast=true``). Arguments, outputs
and FLOPs are the finished executable's exactly (checked in the tests); its temporaries are
not: ``memory_analysis()`` reports more (+7 % for Llama-3.1-8B on v5e:16x16, +68 % for the
70B on v5p:4x4x8, at 128 tokens; for the 70B the compiler's log shows the extra to be its
fragmentation figure counted again, docs/compile.md), so the memory read here is treated as
a lower bound.

What is read: every allocation of the default memory space (HBM, "color 0") in
``*after_optimizations-buffer-assignment.txt``: entry parameters (arguments; those also live
out are aliased outputs), the preallocated temporary buffer (temporaries) and other live-out
buffers (outputs), so ``bytes_peak_estimate`` = arguments + temporaries + outputs not aliased
to an argument, as :func:`tpu_train.compile.program.compiled_analysis` computes it from the
executable. FLOPs are
XLA's HLO cost analysis of ``*after_optimizations.txt`` (run on the CPU client: FLOPs are
counted from the HLO alone, the TPU compiler's own count to the FLOP).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

__all__ = ["buffer_figures", "dump_options", "dumped_figures", "hlo_flops",
           "report_when_dumped"]

_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$", re.MULTILINE)
_COLOR = re.compile(r"\bcolor (\d+)")
_BUFFERS = "after_optimizations-buffer-assignment.txt"
_HLO = "after_optimizations.txt"
_LAST_WRITTEN = "after_optimizations-memory-usage-report.txt"


def dump_options(directory: str) -> dict[str, Any]:
    """Compiler options that make XLA write its optimized HLO and buffer assignment there."""
    return {"xla_dump_to": directory, "xla_dump_hlo_as_text": True}


def buffer_figures(text: str) -> dict[str, int]:
    """Per-chip bytes from a buffer-assignment dump (module docstring)."""
    arguments = aliased = temporaries = outputs = 0
    for size, attributes in _ALLOCATION.findall(text):
        color = _COLOR.search(attributes)
        if color is not None and color.group(1) != "0":
            continue  # on-chip scratch memories, not HBM
        size = int(size)
        live_out = "maybe-live-out" in attributes or attributes.startswith("output")
        if attributes.startswith("parameter"):
            arguments += size
            aliased += size if live_out else 0
        elif "preallocated-temp" in attributes:
            temporaries += size
        elif live_out:
            outputs += size
    return {"argument_size_in_bytes": arguments, "output_size_in_bytes": outputs + aliased,
            "alias_size_in_bytes": aliased, "temp_size_in_bytes": temporaries,
            "bytes_peak_estimate": arguments + temporaries + outputs}


def hlo_flops(text: str) -> float:
    """XLA's HLO cost analysis FLOPs of an HLO module's text (the CPU client's)."""
    import jax
    import jaxlib._hlo as hlo
    from jax._src.lib import xla_client

    module = hlo.hlo_module_from_text(text)
    client = jax.devices("cpu")[0].client
    return float(xla_client._xla.hlo_module_cost_analysis(client, module).get("flops", 0.0))


def _complete(directory: Path) -> tuple[Path, Path] | None:
    """The dumped ``(buffer assignment, optimized HLO)`` once both are written, else None."""
    done = sorted(directory.glob(f"*{_LAST_WRITTEN}"))
    if not done:
        return None
    prefix = str(done[0])[: -len(_LAST_WRITTEN)]
    buffers, hlo_text = Path(prefix + _BUFFERS), Path(prefix + _HLO)
    if not (buffers.is_file() and hlo_text.is_file()):
        return None
    sizes = [p.stat().st_size for p in (buffers, hlo_text, done[0])]
    time.sleep(0.5)  # written by another thread: wait until nothing grows
    if sizes != [p.stat().st_size for p in (buffers, hlo_text, done[0])]:
        return None
    return buffers, hlo_text


def dumped_figures(directory: str) -> tuple[dict[str, Any], str] | None:
    """``(memory and FLOPs figures, optimized HLO text)`` from a dump, or None before the
    compiler has written it."""
    files = _complete(Path(directory))
    if files is None:
        return None
    buffers, hlo_path = files
    figures: dict[str, Any] = buffer_figures(buffers.read_text())
    text = hlo_path.read_text()
    figures["flops_per_device"] = hlo_flops(text)
    return figures, text


def report_when_dumped(directory: str, report: Callable[[dict[str, Any], str], None], *,
                       poll_s: float = 0.5) -> threading.Thread:
    """Watch ``directory``; once the compiler's dump is complete call ``report(figures,
    hlo_text)`` and end this process (status 0), the compile still running. For a process
    that only plans (the plan command's analysis child); ``report`` must flush its output."""

    def watch() -> None:
        while True:
            found = dumped_figures(directory)
            if found is not None:
                break
            time.sleep(poll_s)
        status = 0
        try:
            report(*found)
        except BaseException:  # noqa: BLE001 - said on stderr, then the process ends
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # the compile thread cannot be stopped otherwise

    thread = threading.Thread(target=watch, name="tpu-dump-watch", daemon=True)
    thread.start()
    return thread
