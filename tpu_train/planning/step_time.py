"""A training step's time predicted from its compiled program, kernel by kernel.

:func:`predict_step_time` walks the optimized program the TPU compiler made for the target
(``Compiled.as_text()`` or its ``*after_optimizations.txt`` dump; :mod:`.hlo_program` reads it)
in its schedule's order and adds up what each instruction costs on the chip (:data:`CHIPS`):

* a **kernel** (a fusion, or an unfused op such as a copy) takes the longest of three times:
  its matrix-unit FLOPs (XLA's HLO cost analysis of its fused computation: dots and
  convolutions, counted by the same model as the whole program's FLOPs) at the chip's bf16
  peak times :data:`MXU_EFFICIENCY`; the bytes it moves to and from HBM (its operands and
  results whose layout puts them in HBM, memory space 0, padded to the layout's tile; an
  operand only sliced inside the kernel counts as the slice) at the chip's HBM bandwidth
  times :data:`HBM_EFFICIENCY`; and the TPU compiler's own estimate of its cycles
  (``estimated_cycles`` in the kernel's backend config) at the chip's clock, which covers
  what the first two miss: the vector unit's elementwise work and traffic in the core's
  on-chip memory, where the compiler keeps a small model's arrays. The kernel is
  *compute-bound*, *memory-bound* or *vector-bound* by whichever is longest;
* a **Pallas kernel** (``tpu_custom_call``: the splash attention kernels) carries no FLOPs
  for XLA; its FLOPs come from the cost estimate it carries, else from its operands' shapes
  as causal attention (:func:`attention_kernel_flops`), at :data:`MXU_EFFICIENCY`;
* an **asynchronous copy** (``copy-start`` ... ``copy-done``, ``slice-start`` ... : the
  compiler's prefetches between HBM and on-chip memory) moves its bytes while the kernels
  scheduled between its start and its end run, in the HBM time those kernels leave idle;
  only what does not fit there is *exposed* and adds to the step;
* a **collective** moves its bytes over the chips' links (:func:`collective_wire_bytes`: a
  ring's bytes per chip) at the chip's ICI bandwidth, or its DCN bandwidth where the group
  spans slices; an asynchronous one (``*-start`` ... ``*-done``) overlaps the ops the
  scheduler put between its two halves, a synchronous one is exposed whole;
* a ``while`` loop (a scan over layers or micro-batches) costs its body's time times its trip
  count (:func:`tpu_train.planning.loop_flops.while_loops`); a conditional its costliest
  branch.

The sum is the predicted step time on one chip (every chip runs the same SPMD program).
The efficiencies are the model's calibration, to be fitted on the chip; until then they are
1.0 (the roofline itself) and the figures say so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Callable, Sequence

from .hlo_program import Instruction, arrays, parse_module
from .loop_flops import while_loops
from .tpu_dump import hlo_flops

__all__ = ["CHIPS", "ChipRates", "HBM_EFFICIENCY", "MXU_EFFICIENCY", "attention_kernel_flops",
           "collective_wire_bytes", "get_rates", "predict_step_time"]


@dataclasses.dataclass(frozen=True)
class ChipRates:
    """One TPU generation's rates: dense bf16 FLOP/s, HBM bytes/s, the clock the compiler's
    cycle estimates count in, ICI bytes/s leaving one chip (half the bidirectional figure),
    DCN bytes/s per chip, and where each figure comes from."""

    name: str
    bf16_flops: float
    hbm_bytes_per_s: float
    clock_hz: float
    ici_bytes_per_s: float
    dcn_bytes_per_s: float
    source: str


# Google Cloud's TPU pages (cloud.google.com/tpu/docs/v5e, /v5p, /v6e, /v4: "key chip
# specifications"). The clock is the bf16 peak over the matrix units' MACs per cycle (v5e:
# 4 MXUs of 128 x 128, 2 FLOPs each; v5p: two cores of 4; v6e: 2 of 256 x 256; v4: two cores
# of 4 of 128 x 128). DCN per chip: the host's NICs over its chips (v5e: 2 x 100 Gbps per
# 8 chips; v5p: the page's 50 Gbps per chip; v6e and v4 as v5p's, an assumption).
CHIPS: dict[str, ChipRates] = {
    "v4": ChipRates("v4", 275e12, 1200e9, 275e12 / (2 * 4 * 128 * 128 * 2), 300e9, 6.25e9,
                    "cloud.google.com/tpu/docs/v4: 275 TFLOP/s, 1,200 GB/s HBM, ICI "
                    "2,400 Gbps each way"),
    "v5e": ChipRates("v5e", 197e12, 819e9, 197e12 / (4 * 128 * 128 * 2), 200e9, 3.125e9,
                     "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s, 819 GB/s HBM, ICI 400 GB/s "
                     "bidirectional, 2 x 100 Gbps NICs per 8-chip host"),
    "v5p": ChipRates("v5p", 459e12, 2765e9, 459e12 / (2 * 4 * 128 * 128 * 2), 600e9, 6.25e9,
                     "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s, 2,765 GB/s HBM, ICI "
                     "1,200 GB/s bidirectional, DCN 50 Gbps per chip"),
    "v6e": ChipRates("v6e", 918e12, 1640e9, 918e12 / (2 * 256 * 256 * 2), 400e9, 6.25e9,
                     "cloud.google.com/tpu/docs/v6e: 918 TFLOP/s, 1,640 GB/s HBM, ICI "
                     "800 GB/s bidirectional"),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "trillium": "v6e"}

# The calibration: the fraction of the matrix units' peak a kernel's FLOPs run at, and of
# HBM's bandwidth its bytes move at. 1.0 until fitted on the chip (docs/planning.md).
MXU_EFFICIENCY = 1.0
HBM_EFFICIENCY = 1.0
# Fraction of a causal attention's score square a block-sparse kernel computes: the diagonal
# blocks whole, the rest of the lower triangle (splash attention skips the masked blocks).
CAUSAL_FRACTION = 0.5

# Ops that move no data and compute nothing on the chip.
_FREE = {"parameter", "constant", "get-tuple-element", "bitcast", "tuple", "after-all",
         "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain", "iota",
         "recv", "recv-done"}
# A collective across slices: the TPU compiler hands it to the multi-slice runtime as a host
# transfer, a ``send`` whose attributes name the collective (``ALL_REDUCE``, ...).
_DCN_TRANSFER = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
# Custom calls that are layout bookkeeping, not kernels.
_FREE_CUSTOM_CALLS = {"ConcatBitcast", "AssumeGatherIndicesInBound", "Sharding",
                      "SPMDFullToShardShape", "SPMDShardToFullShape", "MoveToHost",
                      "MoveToDevice", "AllocateBuffer", "LayoutConstraint"}
_COPY_STARTS = {"copy-start", "slice-start", "dynamic-slice-start",
                "dynamic-update-slice-start"}
_COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute", "collective-broadcast", "ragged-all-to-all"}
_SLICING = {"dynamic-slice", "slice", "gather"}
_NO_FRAMES = re.compile(r",? stack_frame_id=\d+")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\})")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[")


def get_rates(name: str) -> ChipRates:
    """The rates of generation ``name`` (``"v5e"``; a topology after ``:`` is ignored)."""
    generation = name.lower().partition(":")[0].strip()
    key = _ALIASES.get(generation, generation)
    if key not in CHIPS:
        raise ValueError(f"no step-time rates for TPU generation {generation!r}; known: "
                         f"{', '.join(CHIPS)}")
    return CHIPS[key]


def _group(inst: Instruction) -> list[int]:
    """The devices of a collective's first group, by their position in the program's device
    order (for a group of the mesh written ``mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``: the
    devices that differ along the named axes, the mesh numbered row-major), or ``[0]`` where
    the groups are not written."""
    mesh = _GROUPS_MESH.search(inst.attributes)
    if mesh:
        sizes = {name: int(size) for name, size in _MESH_AXIS.findall(mesh.group(1))}
        named = set(re.findall(r"'([^']+)'", mesh.group(2)))
        strides, stride = {}, 1
        for name in reversed(list(sizes)):
            strides[name] = stride
            stride *= sizes[name]
        ids = [0]
        for name in named & set(sizes):
            ids = [i + k * strides[name] for i in ids for k in range(sizes[name])]
        return sorted(ids)
    listed = _GROUPS_LIST.search(inst.attributes)
    if listed:
        return [int(m) for m in listed.group(1).strip("{}").split(",") if m] or [0]
    iota = _GROUPS_IOTA.search(inst.attributes)
    if iota:  # [groups, size]<=[n]: the first group, in iota order when not transposed
        dims = [int(d) for d in iota.group(1).split(",")]
        total = math.prod(dims)
        size = dims[-1]
        transposed = "T(" in inst.attributes[iota.end():iota.end() + 40]
        step = total // size if transposed else 1
        return [k * step for k in range(size)]
    return [0]


def collective_wire_bytes(kind: str, operand_bytes: float, result_bytes: float,
                          group: int) -> float:
    """Bytes one chip sends for a collective over ``group`` chips, by a ring: an all-gather
    or a reduce-scatter moves ``(n - 1) / n`` of the whole array, an all-reduce twice that
    (a reduce-scatter then an all-gather), an all-to-all ``(n - 1) / n`` of its input, a
    permute its whole input."""
    if kind == "collective-permute":
        return operand_bytes
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    if kind == "all-gather":
        return share * result_bytes
    if kind == "reduce-scatter":
        return share * operand_bytes
    if kind == "all-reduce":
        return 2 * share * operand_bytes
    return share * operand_bytes


def attention_kernel_flops(inst: Instruction, shapes: dict[str, str]) -> float:
    """FLOPs of a Pallas attention kernel from its operands' shapes: ``q`` is the largest
    operand of the highest rank, 4 or more (``[batch, heads..., seq, head_dim]``; grouped-query
    kernels split the heads as ``kv_heads, group``, and their ``k`` has one dimension fewer),
    ``k`` another operand of ``q``'s dtype and ``head_dim`` (its length ``seq_k`` may differ
    from ``q``'s: a context-parallel shard's queries against the whole sequence's keys). Each
    product of ``q`` with a ``[.., seq_k, head_dim]`` operand over the causal part of the score
    rectangle is ``2 batch heads seq seq_k head_dim x`` :data:`CAUSAL_FRACTION`; a forward
    kernel does two (scores, then values), a dK/dV kernel (two results shaped like ``k``)
    four, a dQ kernel (``q`` and the output's gradient among its operands) three, recomputing
    the scores. 0 for a kernel with no such operands."""
    operands = [a for name in inst.operands for a in arrays(shapes.get(name, ""))[:1]]
    candidates = [a for a in operands if len(a.dims) >= 4]
    if not candidates:
        return 0.0
    rank = max(len(a.dims) for a in candidates)
    q = max((a for a in candidates if len(a.dims) == rank), key=lambda a: math.prod(a.dims))
    head_dim, seq = q.dims[-1], q.dims[-2]
    keys = [a for a in operands if len(a.dims) >= 3 and a.dims[-1] == head_dim and
            a.dtype == q.dtype and a.dims != q.dims]
    seq_k = keys[0].dims[-2] if keys else seq
    heads = math.prod(q.dims[1:-2])
    product = 2.0 * q.dims[0] * heads * seq * seq_k * head_dim * CAUSAL_FRACTION
    if keys and sum(r.dims == keys[0].dims for r in inst.results) >= 2:  # dK and dV
        return 4 * product
    if sum(a.dims == q.dims for a in operands) >= 2:  # dQ: q and the output's gradient
        return 3 * product
    return 2 * product


def _cost_estimate(inst: Instruction) -> tuple[float, float] | None:
    """``(flops, bytes)`` a Pallas kernel's cost estimate gives, or None."""
    found = re.search(r'"cost_estimate"\s*:\s*(\{[^}]*\})', inst.attributes.replace('\\"', '"'))
    if not found:
        return None
    try:
        estimate = json.loads(found.group(1))
    except ValueError:
        return None
    return float(estimate.get("flops", 0)), float(estimate.get("bytes_accessed", 0))


class _Costs:
    """What the walk needs of a module: per-computation FLOPs of fused computations with
    dots or convolutions (XLA's cost analysis, cached) and the shapes of every value."""

    def __init__(self, text: str, flops_of: Callable[[str], float]):
        self.computations, self.entry = parse_module(text)
        self.flops_of = flops_of
        self.shapes = {i.name: i.shape for c in self.computations.values()
                       for i in c.instructions}
        self.trips = dict(while_loops(text))
        self._flops: dict[str, float] = {}
        self._inner: dict[str, Instruction | None] = {}
        # A get-tuple-element's source: an asynchronous op's end reads its start's tuple.
        self.sources = {i.name: i.operands[0] for c in self.computations.values()
                        for i in c.instructions if i.opcode == "get-tuple-element"}

    def _closure(self, name: str) -> list[str]:
        order, stack = [], [name]
        while stack:
            current = stack.pop()
            if current in order or current not in self.computations:
                continue
            order.append(current)
            for inst in self.computations[current].instructions:
                stack.extend(inst.called_all())
        return order

    def fused_flops(self, name: str) -> float:
        if name not in self._flops:
            computation = self.computations.get(name)
            if computation is None or not any(i.opcode in ("convolution", "dot")
                                              for c in self._closure(name)
                                              for i in self.computations[c].instructions):
                self._flops[name] = 0.0
            else:
                parts = ["HloModule kernel"]
                for each in reversed(self._closure(name)):
                    block = self.computations[each].text.removeprefix("ENTRY ")
                    parts.append(("ENTRY " if each == name else "") + block)
                # Stack frames are the whole module's table, not copied: drop their ids.
                self._flops[name] = self.flops_of(_NO_FRAMES.sub("", "\n\n".join(parts)))
        return self._flops[name]

    def collective_inside(self, inst: Instruction) -> Instruction | None:
        """The collective a fusion wraps (the TPU's asynchronous collective fusions and
        all-reduce-scatter fusions), or None."""
        if inst.opcode not in ("fusion", "async-start"):
            return None
        if inst.name not in self._inner:
            self._inner[inst.name] = next(
                (i for c in self._closure(inst.called("calls") or "")
                 for i in self.computations[c].instructions
                 if i.opcode.removesuffix("-start") in _COLLECTIVES), None)
        return self._inner[inst.name]

    def flops_of_instruction(self, inst: Instruction) -> float:
        """XLA's FLOPs of one unfused dot or convolution, analysed alone."""
        shapes = [self.shapes.get(o, "") for o in inst.operands]
        params = ", ".join(f"p{i}: {s}" for i, s in enumerate(shapes))
        lines = [f"  %p{i} = {s} parameter({i})" for i, s in enumerate(shapes)]
        operands = ", ".join(f"%p{i}" for i in range(len(shapes)))
        lines.append(f"  ROOT %{inst.name} = {inst.shape} {inst.opcode}({operands})"
                     f"{inst.attributes}")
        return self.flops_of(f"HloModule one\n\nENTRY %one ({params}) -> {inst.shape} {{\n"
                             + "\n".join(lines) + "\n}")

    def sliced_parameters(self, name: str) -> dict[int, int]:
        """``{parameter index: bytes read}`` of a fused computation's parameters that are
        only sliced inside it (their slices' bytes)."""
        computation = self.computations.get(name)
        if computation is None:
            return {}
        params = {i.name: int(i.operand_text) for i in computation.instructions
                  if i.opcode == "parameter"}
        users: dict[str, list[Instruction]] = {}
        for inst in computation.instructions:
            for operand in inst.operands:
                users.setdefault(operand, []).append(inst)
        out = {}
        for pname, index in params.items():
            using = users.get(pname, [])
            if using and all(u.opcode in _SLICING and u.operands[0] == pname for u in using):
                out[index] = sum(sum(a.nbytes for a in u.results) for u in using)
        return out


@dataclasses.dataclass
class _Tally:
    """A computation's cost: its time, the HBM time its kernels left idle, seconds by part,
    FLOPs and bytes, and each kernel's seconds (by the op it came from)."""

    seconds: float = 0.0
    hbm_idle_s: float = 0.0
    parts: dict[str, float] = dataclasses.field(default_factory=dict)
    totals: dict[str, float] = dataclasses.field(default_factory=dict)
    kernels: dict[tuple[str, str], list[float]] = dataclasses.field(default_factory=dict)

    def part(self, key: str, seconds: float) -> None:
        self.parts[key] = self.parts.get(key, 0.0) + seconds

    def total(self, key: str, amount: float) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + amount

    def add(self, other: "_Tally", times: float) -> None:
        """``other`` run ``times`` times in sequence after what this holds."""
        self.seconds += times * other.seconds
        self.hbm_idle_s += times * other.hbm_idle_s
        for key, value in other.parts.items():
            self.part(key, times * value)
        for key, value in other.totals.items():
            self.total(key, times * value)
        for key, (count, seconds) in other.kernels.items():
            record = self.kernels.setdefault(key, [0.0, 0.0])
            record[0] += times * count
            record[1] += times * seconds


def _op_name(inst: Instruction) -> str:
    found = re.search(r'op_name="([^"]+)"', inst.attributes)
    if not found:
        return inst.opcode
    # "jit(program)/transpose(jvp(jit(<lambda>)))/dot_general": the primitive, and whether
    # it is the backward's (a transpose of the forward) or the forward's.
    path = found.group(1)
    primitive = path.rsplit("/", 1)[-1]
    return ("backward " if "transpose(" in path else "") + primitive


class _Walker:
    def __init__(self, costs: _Costs, rates: ChipRates, device_slices: Sequence[int]):
        self.costs = costs
        self.rates = rates
        self.device_slices = list(device_slices)
        # {link: {collective kind: how many the program has}} (not per run: per site).
        self.kinds: dict[str, dict[str, int]] = {}
        self.memo: dict[str, _Tally] = {}

    def kernel(self, inst: Instruction, tally: _Tally) -> float:
        """A kernel's time by the longest of its three limits (module docstring)."""
        rates = self.rates
        flops, hbm = 0.0, 0.0
        called = inst.called("calls") if inst.opcode == "fusion" else None
        sliced = self.costs.sliced_parameters(called) if called else {}
        for index, operand in enumerate(inst.operands):
            if index in sliced:
                hbm += sliced[index] if arrays(self.costs.shapes.get(operand, ""))[:1] and \
                    arrays(self.costs.shapes[operand])[0].in_hbm else 0
                continue
            hbm += sum(a.nbytes for a in arrays(self.costs.shapes.get(operand, ""))
                       if a.in_hbm)
        hbm += sum(a.nbytes for a in inst.results if a.in_hbm)
        if called:
            flops = self.costs.fused_flops(called)
        elif inst.opcode in ("convolution", "dot"):
            flops = self.costs.flops_of_instruction(inst)
        elif inst.opcode == "custom-call" and _custom_target(inst) == "tpu_custom_call":
            estimate = _cost_estimate(inst)
            flops = estimate[0] if estimate else attention_kernel_flops(
                inst, self.costs.shapes)
        cycles = _CYCLES.search(inst.attributes)
        limits = {"compute": flops / (rates.bf16_flops * MXU_EFFICIENCY),
                  "memory": hbm / (rates.hbm_bytes_per_s * HBM_EFFICIENCY),
                  "vector": int(cycles.group(1)) / rates.clock_hz if cycles else 0.0}
        seconds = max(limits.values())
        # Named by the larger roofline term, whichever limit set the time; a kernel with
        # neither matrix FLOPs nor HBM bytes works in on-chip memory on the vector unit.
        bound = ("vector" if not (flops or hbm) else
                 "compute" if limits["compute"] >= limits["memory"] else "memory")
        tally.seconds += seconds
        tally.hbm_idle_s += seconds - limits["memory"]
        tally.part(f"{bound}_bound_s", seconds)
        tally.part("above_roofline_s", seconds - max(limits["compute"], limits["memory"]))
        tally.total("flops", flops)
        tally.total("hbm_bytes", hbm)
        tally.total("kernels", 1)
        record = tally.kernels.setdefault((bound, _op_name(inst)), [0.0, 0.0])
        record[0] += 1
        record[1] += seconds
        return seconds

    def collective(self, inst: Instruction, tally: _Tally) -> tuple[str, float]:
        """``(link, seconds)`` of a collective, or of the collective inside a collective
        fusion (``link``: ici, or dcn where its group spans slices); its bytes counted."""
        inner = self.costs.collective_inside(inst) or inst
        kind = inner.opcode.removesuffix("-start")
        called = inst.called("calls") or ""
        if kind == "all-reduce" and "reduce-scatter" in called:
            kind = "reduce-scatter"  # the TPU's reduce-scatter: an all-reduce-scatter fusion
        operand = sum(a.nbytes for o in inner.operands
                      for a in arrays(self.costs.shapes.get(o, "")))
        results = inner.results
        result = sum(a.nbytes for a in results) if kind != "all-gather" else \
            max((a.nbytes for a in results), default=0)
        group = _group(inner)
        wire = collective_wire_bytes(kind, operand, result, len(group))
        slices = self.device_slices
        crosses = len({slices[d] if d < len(slices) else 0 for d in group}) > 1
        rate = self.rates.dcn_bytes_per_s if crosses else self.rates.ici_bytes_per_s
        link = "dcn" if crosses else "ici"
        self.kinds.setdefault(link, {}).setdefault(kind, 0)
        self.kinds[link][kind] += 1
        tally.total(f"{link}_bytes", wire)
        tally.total("collectives", 1)
        return link, wire / rate

    def walk(self, name: str) -> _Tally:
        if name in self.memo:
            return self.memo[name]
        tally = _Tally()
        # Asynchronous transfers by link: each link (HBM's time left idle by the kernels for
        # copies; ICI and DCN for collectives) serves them in the order they start.
        queues: dict[str, float] = {}
        pending: dict[str, tuple[str, float]] = {}

        def start(kind: str, seconds: float) -> float:
            now = tally.hbm_idle_s if kind == "copy" else tally.seconds
            queues[kind] = max(now, queues.get(kind, 0.0)) + seconds
            return queues[kind]

        for inst in self.costs.computations[name].instructions:
            op = inst.opcode
            if op in _FREE or (op == "custom-call" and _custom_target(inst) in _FREE_CUSTOM_CALLS):
                continue
            if op in _COPY_STARTS:
                moved = self._copied_bytes(inst)
                tally.total("copy_bytes", moved)
                seconds = moved / (self.rates.hbm_bytes_per_s * HBM_EFFICIENCY)
                pending[inst.name] = ("copy", start("copy", seconds))
            elif (op.endswith("-start") and op.removesuffix("-start") in _COLLECTIVES) or (
                    op == "async-start" and self.costs.collective_inside(inst) is not None):
                link, seconds = self.collective(inst, tally)
                pending[inst.name] = (link, start(link, seconds))
            elif op == "send":
                transfer = _DCN_TRANSFER.search(inst.attributes)
                if transfer:
                    seconds = self.dcn_transfer(inst, transfer.group(1), tally)
                    pending[inst.name] = ("dcn", start("dcn", seconds))
            elif op.endswith("-done") or "collective-done" in inst.name:
                operands = [self.costs.sources.get(o, o) for o in inst.operands]
                started = next((pending.pop(o) for o in operands if o in pending), None)
                if started is not None:
                    self._finish(*started, tally)
            elif op in _COLLECTIVES:
                link, seconds = self.collective(inst, tally)
                self._finish(link, start(link, seconds), tally)
            elif self.costs.collective_inside(inst) is not None:
                link, seconds = self.collective(inst, tally)
                # Its own work (a matmul the compiler fused with a reduce-scatter) runs
                # while it transfers.
                at = tally.seconds
                self.kernel(inst, tally)
                if "collective-start" in inst.name:
                    queues[link] = max(at, queues.get(link, 0.0)) + seconds
                    pending[inst.name] = (link, queues[link])
                else:
                    queues[link] = max(at, queues.get(link, 0.0)) + seconds
                    self._finish(link, queues[link], tally)
            elif op == "while":
                body = self.walk(inst.called("body"))
                trips = self.costs.trips.get(inst.called("body")) or 1
                tally.add(body, trips)
                tally.total("loop_iterations", trips)
            elif op in ("call", "async-start") or op == "conditional":
                branches = [self.walk(c) for c in inst.called_all() if c in self.costs.computations]
                if branches:
                    tally.add(max(branches, key=lambda t: t.seconds), 1)
            else:
                self.kernel(inst, tally)
        for started in pending.values():  # never waited for inside: exposed at the end
            self._finish(*started, tally)
        self.memo[name] = tally
        return tally

    def dcn_transfer(self, inst: Instruction, transfer: str, tally: _Tally) -> float:
        """Seconds of a collective the multi-slice runtime runs across slices (``transfer``:
        ``ALL_REDUCE``, ...), its bytes counted: this chip's operand, a ring over the slices."""
        kind = transfer.lower().replace("_", "-")
        sent = sum(a.nbytes for o in inst.operands[:1]
                   for a in arrays(self.costs.shapes.get(o, "")))
        wire = collective_wire_bytes(kind, sent, sent, max(2, len(set(self.device_slices))))
        self.kinds.setdefault("dcn", {}).setdefault(kind, 0)
        self.kinds["dcn"][kind] += 1
        tally.total("dcn_bytes", wire)
        tally.total("collectives", 1)
        return wire / self.rates.dcn_bytes_per_s

    def _copied_bytes(self, inst: Instruction) -> float:
        """HBM bytes an asynchronous copy moves: what it writes, once for each of its two
        ends in HBM. A copy-start's result is ``(destination, source, context)``, a
        slice-start's ``((source,), slice, context)``: the slice alone moves."""
        source = next((a for o in inst.operands
                       for a in arrays(self.costs.shapes.get(o, ""))), None)
        results = inst.results
        if source is None or len(results) < 2:
            return 0.0
        written = results[0] if inst.opcode == "copy-start" else results[-2]
        return written.nbytes * (int(source.in_hbm) + int(written.in_hbm))

    @staticmethod
    def _finish(kind: str, done_at: float, tally: _Tally) -> None:
        """An asynchronous transfer's end, due at ``done_at`` on its link's clock: the wait,
        if it is not done yet, is exposed (no kernel runs meanwhile: HBM is idle too)."""
        now = tally.hbm_idle_s if kind == "copy" else tally.seconds
        exposed = max(0.0, done_at - now)
        tally.seconds += exposed
        tally.hbm_idle_s += exposed
        tally.part(f"exposed_{kind}_s", exposed)


def _custom_target(inst: Instruction) -> str:
    found = _TARGET.search(inst.attributes)
    return found.group(1) if found else ""


def predict_step_time(text: str, chip: str, *, device_slices: Sequence[int] = (),
                      model_flops_per_chip: float | None = None,
                      flops_of: Callable[[str], float] | None = None,
                      top: int = 8) -> dict[str, Any]:
    """The predicted time of one run of the program ``text`` (an optimized HLO module) on
    one chip of generation ``chip`` (module docstring), with where it goes.

    ``device_slices``: the slice of each of the program's devices, in its device order (the
    mesh's devices, row-major): a collective whose group spans slices crosses DCN; empty,
    one slice. ``model_flops_per_chip`` (the model's FLOPs a step, per chip): the
    MFU at the predicted time. ``flops_of`` (tests): HLO text -> FLOPs, XLA's cost analysis
    on this host's CPU client by default.
    """
    rates = get_rates(chip)
    costs = _Costs(text, flops_of or hlo_flops)
    walker = _Walker(costs, rates, device_slices)
    tally = walker.walk(costs.entry)
    parts = {key: tally.parts.get(key, 0.0) for key in
             ("compute_bound_s", "memory_bound_s", "vector_bound_s", "exposed_copy_s",
              "exposed_ici_s", "exposed_dcn_s", "above_roofline_s")}
    kernels = sorted(tally.kernels.items(), key=lambda item: -item[1][1])[:top]
    out: dict[str, Any] = {
        "chip": rates.name, "step_time_s": tally.seconds, **parts,
        "flops_per_chip": tally.totals.get("flops", 0.0),
        "hbm_bytes_per_chip": tally.totals.get("hbm_bytes", 0.0),
        "copy_bytes_per_chip": tally.totals.get("copy_bytes", 0.0),
        "ici_bytes_per_chip": tally.totals.get("ici_bytes", 0.0),
        "dcn_bytes_per_chip": tally.totals.get("dcn_bytes", 0.0),
        "kernels_run": int(tally.totals.get("kernels", 0)),
        "collectives_run": int(tally.totals.get("collectives", 0)),
        "collectives_by_link": walker.kinds,
        "top_kernels": [{"bound": bound, "op": op, "runs": int(count), "seconds": seconds}
                        for (bound, op), (count, seconds) in kernels],
        "efficiency": {"mxu": MXU_EFFICIENCY, "hbm": HBM_EFFICIENCY},
        "basis": (f"{rates.name}: {rates.bf16_flops / 1e12:.0f} bf16 TFLOP/s x MXU efficiency "
                  f"{MXU_EFFICIENCY:g}, HBM {rates.hbm_bytes_per_s / 1e9:.0f} GB/s x "
                  f"{HBM_EFFICIENCY:g}, the compiler's cycle estimates at "
                  f"{rates.clock_hz / 1e9:.2f} GHz, ICI {rates.ici_bytes_per_s / 1e9:.0f} GB/s "
                  f"and DCN {rates.dcn_bytes_per_s / 1e9:.2f} GB/s per chip "
                  f"({rates.source})"),
    }
    if model_flops_per_chip and tally.seconds > 0:
        out["mfu"] = model_flops_per_chip / tally.seconds / rates.bf16_flops
    return out
