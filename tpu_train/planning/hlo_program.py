"""An optimized HLO module's text read back as computations of instructions with shapes.

What the step-time model (:mod:`tpu_train.planning.step_time`) needs of a compiled program
(``Compiled.as_text()``, or the compiler's ``*after_optimizations.txt`` dump): each
computation's instructions in the order the module prints them (a scheduled module,
``is_scheduled=true``, prints each computation in its schedule's order), each instruction's
opcode, operands, attributes and result arrays, and each array's bytes as the TPU lays it
out: dimensions padded to the layout's tile (``T(8,128)``: a ``[4, 64]`` array of 16-bit
elements takes a whole 8 x 128 tile) and the memory space it lives in (``S(1)``: the core's
on-chip vector memory, not HBM).
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = ["Array", "Computation", "Instruction", "arrays", "parse_module"]

_DTYPE_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8,
               "f8e4m3b11fnuz": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32,
               "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BITS, key=len, reverse=True))
                    + r")\[([\d,]*)\](?:\{([^}]*)\})?")
_TILE = re.compile(r"T\(([\d,]+)\)")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_HEADER = re.compile(r"^(ENTRY )?%([^\s(]+)")
_NAME = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = ")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9-]*)\(")
_OPERAND = re.compile(r"%([^\s,)]+)")


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of a shape: its element type, dimensions, bytes as laid out, memory space
    (0: HBM; 1: the core's vector memory; others: small on-chip memories)."""

    dtype: str
    dims: tuple[int, ...]
    nbytes: int
    memory_space: int = 0

    @property
    def in_hbm(self) -> bool:
        return self.memory_space == 0


def _laid_out_bytes(dtype: str, dims: tuple[int, ...], layout: str | None) -> int:
    """Bytes of an array with its physical minor dimensions padded to the layout's first
    tile (the element count alone where the layout names none)."""
    bits = _DTYPE_BITS[dtype]
    if not layout or not dims:
        return math.ceil(math.prod(dims) * bits / 8)
    order, _, rest = layout.partition(":")
    tile = _TILE.search(rest)
    try:
        minor_to_major = [int(d) for d in order.split(",") if d]
    except ValueError:
        minor_to_major = []
    if tile is None or sorted(minor_to_major) != list(range(len(dims))):
        return math.ceil(math.prod(dims) * bits / 8)
    physical = [dims[d] for d in reversed(minor_to_major)]  # major to minor
    sizes = [int(t) for t in tile.group(1).split(",")]
    for offset, size in enumerate(reversed(sizes), start=1):
        if offset <= len(physical):
            physical[-offset] = -(-physical[-offset] // size) * size
    return math.ceil(math.prod(physical) * bits / 8)


def arrays(shape: str) -> list[Array]:
    """Every array of an HLO shape's text (a tuple's in order; tokens have none)."""
    found = []
    for dtype, dims_text, layout in _ARRAY.findall(shape):
        dims = tuple(int(d) for d in dims_text.split(",") if d)
        space = _MEMORY_SPACE.search(layout.partition(":")[2]) if layout else None
        found.append(Array(dtype, dims, _laid_out_bytes(dtype, dims, layout or None),
                           int(space.group(1)) if space else 0))
    return found


@dataclasses.dataclass
class Instruction:
    """One HLO instruction: ``%name = shape opcode(operands), attributes``."""

    name: str
    opcode: str
    shape: str
    operands: list[str]
    attributes: str
    root: bool = False
    operand_text: str = ""  # between the parentheses: a parameter's index, a constant

    @property
    def results(self) -> list[Array]:
        return arrays(self.shape)

    def called(self, key: str) -> str | None:
        """The computation named by attribute ``key`` (``calls``, ``body``, ...), or None."""
        found = re.search(rf"\b{key}=%([^\s,}}]+)", self.attributes)
        return found.group(1) if found else None

    def called_all(self) -> list[str]:
        """Every computation this instruction names (fused, loop, branch or reducer)."""
        names = re.findall(r"\b(?:calls|to_apply|body|condition|true_computation|"
                           r"false_computation)=%([^\s,}]+)", self.attributes)
        branches = re.search(r"branch_computations=\{([^}]*)\}", self.attributes)
        if branches:
            names += _OPERAND.findall(branches.group(1))
        return names


@dataclasses.dataclass
class Computation:
    name: str
    text: str
    instructions: list[Instruction]
    entry: bool = False

    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis group opening at ``text[start]``."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "(":
            depth += 1
        elif text[index] == ")":
            depth -= 1
            if depth == 0:
                return index + 1
    return len(text)


def _instruction(line: str) -> Instruction | None:
    named = _NAME.match(line)
    if named is None:
        return None
    rest = line[named.end():]
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.find(" ")
        end = len(rest) if end < 0 else end
    shape, rest = rest[:end], rest[end:]
    opcode = _OPCODE.match(rest)
    if opcode is None:
        return None
    open_at = opcode.end() - 1
    close_at = _balanced(rest, open_at)
    operands = _OPERAND.findall(rest[open_at:close_at])
    return Instruction(named.group(1), opcode.group(1), shape, operands,
                       rest[close_at:], root=line.lstrip().startswith("ROOT "),
                       operand_text=rest[open_at + 1:close_at - 1])


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """``({name: computation}, entry computation's name)`` of an HLO module's text."""
    computations: dict[str, Computation] = {}
    entry = ""
    for block in re.split(r"\n\s*\n(?=(?:ENTRY )?%)", text.strip()):
        header = _HEADER.match(block.lstrip())
        if header is None:
            continue
        lines = block.strip().splitlines()
        body = [_instruction(line) for line in lines[1:]]
        name = header.group(2)
        computations[name] = Computation(name, block.strip(), [i for i in body if i],
                                         entry=bool(header.group(1)))
        if header.group(1):
            entry = name
    return computations, entry
