"""Where XLA's TPU compiler spends a compile: its stages and its slowest kernels, from libtpu's log.

libtpu writes an INFO log (``tpu_driver.INFO`` in ``TPU_LOG_DIR``) with the duration of each
compile stage (``HLO_PASSES``, ``BACKEND_PASSES``, ``CODE_GENERATION``, ``END_TO_END``), the
final bundle count and the executable's fingerprint (equal fingerprints: the same device
program, bit for bit). With ``--vmodule=deepsea_compiler_backend=2`` it also names each kernel
the backend starts (``[fusion.32] LLO optimizing 171,288 instructions``) on one of its worker
threads; the time until that thread starts its next kernel (for its last one: the thread's last
line) is the kernel's backend time.
``scripts/tpu_compile.py --compile-log`` sets this up and adds :func:`summarize`'s result to
its JSON line.
"""

from __future__ import annotations

import re

# The last line libtpu writes about a compile.
FINAL_LINE = "END_TO_END stage duration"
# What libtpu needs in LIBTPU_INIT_ARGS (read when libtpu starts): name the kernels, and write
# INFO lines at once (its log buffers them for up to 30 s otherwise, past a short compile).
LIBTPU_ARGS = "--vmodule=deepsea_compiler_backend=2 --logbuflevel=-1"

_LINE = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d(?:\.\d+)?)\s+(\d+) \S+\] (.*)$")
_STAGE = re.compile(r"^([A-Z_]+) stage duration: (.+)$")
_KERNEL = re.compile(r"^\[(.*)\] LLO optimizing ([\d,]+) instructions$")
_BUNDLES = re.compile(r"^final program bundle count: ([\d,]+)")
_FINGERPRINT = re.compile(r"Executable fingerprint:([0-9a-f]+)$")
_PROGRAM = "<no-hlo-instruction>"
_DURATION_PART = re.compile(r"([\d.]+)(ms|us|ns|h|m|s)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def duration_seconds(text: str) -> float:
    """``"1m38.12s"`` -> 98.12 (libtpu's durations: hours, minutes, s, ms, us, ns)."""
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise ValueError(f"not a libtpu duration: {text!r}")
    return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)


def summarize(log: str, top: int = 10) -> dict:
    """The compile's stages (seconds), bundle count, executable fingerprint and its ``top``
    slowest kernels ``[name, LLO instructions, backend seconds]``, from libtpu's INFO log of
    one compile. Kernels are counted only where the log names them (see the module doc)."""
    stages: dict[str, float] = {}
    bundles = fingerprint = None
    running: dict[str, list] = {}  # thread -> [name, instructions, start]
    last_line_at: dict[str, float] = {}  # thread -> time of its latest line
    kernels: list[list] = []
    for line in log.splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        hours, minutes, seconds, thread, message = match.groups()
        at = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
        last_line_at[thread] = at
        if (stage := _STAGE.match(message)) is not None:
            stages[stage[1].lower()] = round(duration_seconds(stage[2]), 2)
        elif (kernel := _KERNEL.match(message)) is not None:
            if thread in running:
                kernels.append(_finished(running[thread], at))
            running[thread] = [kernel[1], int(kernel[2].replace(",", "")), at]
        elif (found := _BUNDLES.match(message)) is not None:
            bundles = int(found[1].replace(",", ""))
        elif (found := _FINGERPRINT.search(message)) is not None and fingerprint is None:
            fingerprint = found[1]
    # A thread's last kernel ends with the thread's last line.
    kernels.extend(_finished(kernel, last_line_at[thread]) for thread, kernel in running.items())
    # The program's own code (no HLO instruction) starts first and waits for all the kernels.
    kernels = [kernel for kernel in kernels if kernel[0] != _PROGRAM]
    kernels.sort(key=lambda kernel: -kernel[2])
    total = sum(kernel[2] for kernel in kernels)
    return {"stages_s": stages, "bundles": bundles, "executable_fingerprint": fingerprint,
            "kernels": len(kernels), "kernels_backend_s": round(total, 1),
            "top_kernels": [[name, size, round(s, 2)] for name, size, s in kernels[:top]],
            "top_kernels_share": round(sum(k[2] for k in kernels[:top]) / total, 2)
            if total else None}


_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_CALLED = re.compile(r"(?:body|condition|to_apply|branch_computations|calls)=\{?%?([\w.\-]+)")


def _computations(hlo_text: str) -> tuple[dict, str | None]:
    """``({computation: [instruction lines]}, the entry's name)`` of an HLO module's text."""
    found: dict[str, list[str]] = {}
    entry = current = None
    for line in hlo_text.splitlines():
        if current is None:
            header = _COMPUTATION.match(line)
            if header is not None and " -> " in line:
                current = header[2]
                found[current] = []
                entry = current if header[1] else entry
        elif line == "}":
            current = None
        else:
            found[current].append(line)
    return found, entry


def kernels_by_computation(log: str, hlo_text: str) -> dict:
    """The kernels of libtpu's log, summed by where their instruction sits in the optimized
    program (``hlo_text``): ``entry``, ``loop 1``, ``loop 2``... (each ``while`` of the entry
    computation in program order, with whatever its body and condition call), ``other``:
    ``{part: {"kernels", "llo_instructions", "backend_s"}}``. A scanned program's loop bodies
    are compiled once however deep the stack; what grows with depth is in ``entry``."""
    computations, entry = _computations(hlo_text)
    owner: dict[str, str] = {}
    if entry is not None:
        owner[entry] = "entry"
        loops = [line for line in computations[entry] if " while(" in line]
        for number, line in enumerate(loops, 1):
            pending = [name for name in _CALLED.findall(line)]
            while pending:
                name = pending.pop()
                if name in owner or name not in computations:
                    continue
                owner[name] = f"loop {number}"
                pending.extend(_CALLED.findall("\n".join(computations[name])))
    part_of = {}
    for name, lines in computations.items():
        for line in lines:
            if (instruction := _INSTRUCTION.match(line)) is not None:
                part_of.setdefault(instruction[1], owner.get(name, "other"))
    parts: dict[str, dict] = {}
    for name, instructions, seconds in summarize(log, top=1 << 30)["top_kernels"]:
        part = parts.setdefault(part_of.get(name, "other"),
                                {"kernels": 0, "llo_instructions": 0, "backend_s": 0.0})
        part["kernels"] += 1
        part["llo_instructions"] += instructions
        part["backend_s"] = round(part["backend_s"] + seconds, 2)
    order = ["entry"] + [f"loop {n}" for n in range(1, len(parts) + 1)] + ["other"]
    return {part: parts[part] for part in order if part in parts}


def _finished(kernel: list, at: float) -> list:
    name, instructions, started = kernel
    return [name, instructions, max(0.0, at - started)]
