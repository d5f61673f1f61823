"""FLOPs of a compiled program with its ``while`` loops counted as many times as they run.

XLA's cost analysis (``Compiled.cost_analysis()``) counts each ``while`` loop's body once:
a step whose decoder layers are scanned (one loop for the forward, one for the backward)
reports the FLOPs of the embedding, the head, the optimizer and *one* layer. Here the
optimized program (``Compiled.as_text()``) is read back and, for every loop whose trip count
its condition states (``counter < N`` against a constant, as ``lax.scan`` lowers), the body
is made the entry computation of a module of its own and analysed by the same cost model
(XLA's ``HloCostAnalysis`` through the CPU client: FLOPs are counted from the HLO, the
same figure for any backend; checked against the TPU compiler's own count of the whole
program in the tests).

A body's figure counts the loops nested in it once each (XLA's rule again), and a nested loop
runs its trips on every iteration of the loops around it (the blockwise attention inside a
scanned layer, for one). So each body's own FLOPs (its figure less its nested loops' figures)
are counted once per iteration of every loop around it: a loop's FLOPs are
``N x (own + the same for each nested loop)``, and the program's XLA's figure with each
outermost loop's single count replaced by that. A loop of unknown trip count is counted as
running once. A ``while`` inside a computation that no loop body contains directly (a
``call``'s, say) is counted as an outermost loop.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["loop_flops", "while_loops"]

_COMPUTATION = re.compile(r"\n\n(?=(?:ENTRY )?%)")
_NAME = re.compile(r"(?:ENTRY )?%([^\s(]+)")
_WHILE = re.compile(r" while\([^\n]*?condition=%([^\s,]+), body=%([^\s,]+)")
# lax.scan's condition: ``compare(counter, constant(N)), direction=LT`` with N an s32.
_TRIP_CONSTANT = re.compile(r"%([^\s=]+) = s32\[\][^=\n]* constant\((\d+)\)")
_COMPARE_LT = re.compile(r"ROOT [^\n]*compare\([^)]*%([^\s,)]+)\)[^\n]*direction=LT")


def _split(text: str) -> tuple[str, dict[str, str]]:
    """``(module header, {computation name: its text})`` of an HLO module's text."""
    header, *blocks = _COMPUTATION.split(text.strip())
    return header, {_NAME.match(b).group(1): b for b in blocks}


def _trip_count(condition: str) -> int | None:
    """N of a ``counter < N`` loop condition, or None if it is not of that form."""
    root = _COMPARE_LT.search(condition)
    if root is None:
        return None
    constants = dict(_TRIP_CONSTANT.findall(condition))
    return int(constants[root.group(1)]) if root.group(1) in constants else None


def while_loops(text: str) -> list[tuple[str, int | None]]:
    """``(body computation, trip count or None)`` of every ``while`` in an HLO module."""
    _, computations = _split(text)
    return [(body, _trip_count(computations.get(cond, "")))
            for cond, body in _WHILE.findall(text)]


def _nested_loops(computations: dict[str, str]) -> dict[str, list[tuple[str, int | None]]]:
    """``{computation: [(body, trip count or None), ...]}``: the loops each computation runs
    directly."""
    return {name: [(body, _trip_count(computations.get(cond, "")))
                   for cond, body in _WHILE.findall(block)]
            for name, block in computations.items()}


def _as_entry(header: str, computations: dict[str, str], entry: str) -> str:
    """The module's text with ``entry`` as its entry computation (the rest kept as is)."""
    # The first header line carries the old entry's layout and aliasing: keep only the
    # name; the tables after it (file names, stack frames) stay for the metadata.
    first, _, tables = header.partition("\n")
    parts = ["HloModule loop_body" + ("\n" + tables if tables else "")]
    for name, block in computations.items():
        block = block.removeprefix("ENTRY ")
        parts.append("ENTRY " + block if name == entry else block)
    return "\n\n".join(parts)


def _cost_model():
    """``text -> FLOPs`` by XLA's HLO cost analysis (the CPU client's)."""
    import jax
    import jaxlib._hlo as hlo
    from jax._src.lib import xla_client

    client = jax.devices("cpu")[0].client

    def flops(text: str) -> float:
        module = hlo.hlo_module_from_text(text)
        return float(xla_client._xla.hlo_module_cost_analysis(client, module).get("flops", 0.0))

    return flops


def loop_flops(text: str, xla_flops: float) -> dict[str, Any]:
    """``flops_per_device`` with every loop body counted per iteration, XLA's own figure as
    ``flops_per_device_raw``, and ``flops_note`` saying what was done (module docstring)."""
    out: dict[str, Any] = {"flops_per_device": xla_flops, "flops_per_device_raw": xla_flops}
    if not while_loops(text):
        return out
    header, computations = _split(text)
    nested = _nested_loops(computations)
    bodies = {body for loops in nested.values() for body, _ in loops}
    cost_model = _cost_model()
    figure: dict[str, float] = {}  # a body's FLOPs as XLA counts them (nested loops once)

    def xla_figure(body: str) -> float:
        if body not in figure:
            figure[body] = cost_model(_as_entry(header, computations, body))
        return figure[body]

    def every_iteration(body: str) -> float:
        """One run of ``body`` with the loops in it counted per iteration."""
        inner = nested.get(body, [])
        own = xla_figure(body) - sum(xla_figure(b) for b, _ in inner)
        return own + sum((trips or 1) * every_iteration(b) for b, trips in inner)

    added, counted, unknown = 0.0, [], 0
    for container, loops in nested.items():
        if container in bodies:
            continue  # counted with the loop around it
        for body, trips in loops:
            unknown += trips is None
            total = (trips or 1) * every_iteration(body)
            added += total - xla_figure(body)
            counted.append(f"{trips or 1} x {total / (trips or 1):.3e}")
    unknown += sum(trips is None for c, loops in nested.items() if c in bodies
                   for _, trips in loops)
    out["flops_per_device"] = xla_flops + added
    inner = sum(len(loops) for c, loops in nested.items() if c in bodies)
    out["flops_note"] = (f"XLA counts a loop body once; {len(counted)} loop bodies counted per "
                         f"iteration ({', '.join(counted) or 'none'})"
                         + (f", {inner} loop(s) nested in them per iteration of theirs"
                            if inner else "")
                         + f" add {added:.3e} to XLA's {xla_flops:.3e}"
                         + (f"; {unknown} loop(s) of unknown trip count counted once"
                            if unknown else ""))
    return out
