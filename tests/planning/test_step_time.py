"""The step-time model read from a compiled program (tpu_train.planning.step_time): a scheduled
module written here, costed by hand from the chip's published rates; the TPU compiler's own
program of a small sharded step is in test_tpu_analysis.py."""

from __future__ import annotations

import pytest

from tpu_train.planning import hlo_program, step_time
from tpu_train.planning.step_time import CHIPS, predict_step_time

V5E = CHIPS["v5e"]

# One step, scheduled: a matmul fusion (HBM operands), a prefetch to on-chip memory overlapped
# by an on-chip kernel, a scanned loop of 4 trips, and two all-gathers over a 4 x 2 mesh.
PROGRAM = """HloModule step, is_scheduled=true

%fused_dot (p0: bf16[128,256], p1: bf16[256,512]) -> bf16[128,512] {
  %p0 = bf16[128,256]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[256,512]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %dot.1 = bf16[128,512]{1,0:T(8,128)(2,1)} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_scale (p0.1: f32[1024,1024]) -> f32[1024,1024] {
  %p0.1 = f32[1024,1024]{1,0:T(8,128)S(1)} parameter(0)
  ROOT %m.1 = f32[1024,1024]{1,0:T(8,128)S(1)} multiply(%p0.1, %p0.1)
}

%body (loop: (s32[], f32[1024,1024])) -> (s32[], f32[1024,1024]) {
  %loop = (s32[], f32[1024,1024]{1,0:T(8,128)S(1)}) parameter(0)
  %i = s32[] get-tuple-element(%loop), index=0
  %x = f32[1024,1024]{1,0:T(8,128)S(1)} get-tuple-element(%loop), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[1024,1024]{1,0:T(8,128)S(1)} fusion(%x), kind=kLoop, calls=%fused_scale, backend_config={"estimated_cycles":"1500"}
  ROOT %out = (s32[], f32[1024,1024]{1,0:T(8,128)S(1)}) tuple(%next, %y)
}

%cond (loop.1: (s32[], f32[1024,1024])) -> pred[] {
  %loop.1 = (s32[], f32[1024,1024]{1,0:T(8,128)S(1)}) parameter(0)
  %i.1 = s32[] get-tuple-element(%loop.1), index=0
  %trips = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %trips), direction=LT
}

ENTRY %main (a: bf16[128,256], b: bf16[256,512], c: f32[1024,1024], w: f32[256,256]) -> (bf16[128,512], f32[1024,1024], f32[1024,256], f32[512,256]) {
  %a = bf16[128,256]{1,0:T(8,128)(2,1)} parameter(0)
  %b = bf16[256,512]{1,0:T(8,128)(2,1)} parameter(1)
  %c = f32[1024,1024]{1,0:T(8,128)} parameter(2)
  %w = f32[256,256]{1,0:T(8,128)} parameter(3)
  %mm = bf16[128,512]{1,0:T(8,128)(2,1)} fusion(%a, %b), kind=kOutput, calls=%fused_dot, backend_config={"estimated_cycles":"100"}
  %cs = (f32[1024,1024]{1,0:T(8,128)S(1)}, f32[1024,1024]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%c)
  %z = s32[] constant(0)
  %init = (s32[], f32[1024,1024]{1,0:T(8,128)S(1)}) tuple(%z, %c)
  %scan = (s32[], f32[1024,1024]{1,0:T(8,128)S(1)}) while(%init), condition=%cond, body=%body
  %cd = f32[1024,1024]{1,0:T(8,128)S(1)} copy-done(%cs)
  %fsdp = f32[1024,256]{1,0:T(8,128)} all-gather(%w), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}, use_global_device_ids=true
  %tp = f32[512,256]{1,0:T(8,128)} all-gather(%w), channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, dimensions={0}, use_global_device_ids=true
  ROOT %t = (bf16[128,512]{1,0:T(8,128)(2,1)}, f32[1024,1024]{1,0:T(8,128)S(1)}, f32[1024,256]{1,0:T(8,128)}, f32[512,256]{1,0:T(8,128)}) tuple(%mm, %cd, %fsdp, %tp)
}
"""


def test_arrays_are_laid_out_in_tiles_and_memory_spaces():
    (tile_padded,) = hlo_program.arrays("bf16[4,64]{1,0:T(8,128)(2,1)}")
    assert tile_padded.nbytes == 8 * 128 * 2 and tile_padded.in_hbm
    # Minor-to-major {1,0}: the 4 is the minor dimension, padded to 128; {0,1}: the 64 is,
    # and the 4 rows pad to 8.
    assert hlo_program.arrays("f32[64,4]{1,0:T(8,128)}")[0].nbytes == 64 * 128 * 4
    assert hlo_program.arrays("f32[64,4]{0,1:T(8,128)}")[0].nbytes == 8 * 128 * 4
    started = hlo_program.arrays(
        "(f32[1024]{0:T(1024)S(1)}, f32[1024]{0:T(1024)}, u32[]{:S(2)})")
    assert [(a.memory_space, a.nbytes) for a in started] == [(1, 4096), (0, 4096), (2, 4)]
    assert hlo_program.arrays("s32[3,5]")[0].nbytes == 60  # no layout: the elements


def test_the_module_is_read_as_computations_in_schedule_order():
    computations, entry = hlo_program.parse_module(PROGRAM)
    assert entry == "main"
    assert set(computations) == {"fused_dot", "fused_scale", "body", "cond", "main"}
    ops = [i.opcode for i in computations["main"].instructions]
    assert ops[4:10] == ["fusion", "copy-start", "constant", "tuple", "while", "copy-done"]
    scan = computations["main"].by_name()["scan"]
    assert (scan.called("body"), scan.called("condition")) == ("body", "cond")
    assert computations["main"].by_name()["mm"].operands == ["a", "b"]


def test_each_part_of_the_program_costs_what_the_chip_rates_say():
    out = predict_step_time(PROGRAM, "v5e")
    # The matmul: 2 x 128 x 256 x 512 FLOPs (XLA's count) against its 458,752 HBM bytes:
    # memory-bound, 0.56 us, above its 100 compiler cycles.
    flops = 2 * 128 * 256 * 512
    matmul = (128 * 256 + 256 * 512 + 128 * 512) * 2 / V5E.hbm_bytes_per_s
    assert out["flops_per_chip"] == flops
    # Each trip's counter increment reads two 4-byte scalars and writes one.
    counter = 4 * 12 / V5E.hbm_bytes_per_s
    assert out["memory_bound_s"] == pytest.approx(matmul + counter)
    # The loop: 4 trips of a 1,500-cycle kernel working in on-chip memory.
    loop = 4 * 1500 / V5E.clock_hz
    assert out["vector_bound_s"] == pytest.approx(loop)
    # The 4 MiB prefetch runs in the HBM time the loop leaves idle; the rest is exposed.
    prefetch = 1024 * 1024 * 4 / V5E.hbm_bytes_per_s
    assert out["exposed_copy_s"] == pytest.approx(prefetch - loop)
    # All-gathers, synchronous: 3/4 of 1 MiB over 4 chips, 1/2 of 512 KiB over 2.
    wire = 0.75 * 1024 * 256 * 4 + 0.5 * 512 * 256 * 4
    assert out["ici_bytes_per_chip"] == pytest.approx(wire)
    assert out["exposed_ici_s"] == pytest.approx(wire / V5E.ici_bytes_per_s)
    assert out["dcn_bytes_per_chip"] == 0
    assert out["step_time_s"] == pytest.approx(
        matmul + counter + loop + (prefetch - loop) + wire / V5E.ici_bytes_per_s)
    assert out["kernels_run"] == 1 + 4 * 2 and out["collectives_run"] == 2


def test_a_group_spanning_slices_crosses_dcn_and_one_inside_a_slice_does_not():
    # Two slices of 4 chips: devices 0-3 and 4-7 of the row-major 4 x 2 mesh. The group
    # along axis_0 (devices 0, 2, 4, 6) spans both, the one along axis_1 (0, 1) one slice.
    out = predict_step_time(PROGRAM, "v5e", device_slices=[0, 0, 0, 0, 1, 1, 1, 1])
    assert out["dcn_bytes_per_chip"] == pytest.approx(0.75 * 1024 * 256 * 4)
    assert out["ici_bytes_per_chip"] == pytest.approx(0.5 * 512 * 256 * 4)
    assert out["exposed_dcn_s"] == pytest.approx(0.75 * 1024 * 256 * 4 / V5E.dcn_bytes_per_s)
    assert out["collectives_by_link"] == {"dcn": {"all-gather": 1}, "ici": {"all-gather": 1}}


def _gather_around_matmul(overlapped: bool) -> str:
    """The matmul of PROGRAM and an asynchronous all-gather started before it, done after
    it (``overlapped``) or before it."""
    start = ("  %g.s = (f32[256,256]{1,0:T(8,128)}, f32[1024,256]{1,0:T(8,128)}) "
             "all-gather-start(%w), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=2] "
             "{'axis_0'}, dimensions={0}, use_global_device_ids=true")
    done = "  %g = f32[1024,256]{1,0:T(8,128)} all-gather-done(%g.s)"
    matmul = ("  %mm = bf16[128,512]{1,0:T(8,128)(2,1)} fusion(%a, %b), kind=kOutput, "
              "calls=%fused_dot")
    body = [start, matmul, done] if overlapped else [start, done, matmul]
    dot = PROGRAM.split("\n\n")[1]
    return "\n".join([
        "HloModule gather, is_scheduled=true", "", dot, "",
        "ENTRY %main (a: bf16[128,256], b: bf16[256,512], w: f32[256,256]) -> "
        "(bf16[128,512], f32[1024,256]) {",
        "  %a = bf16[128,256]{1,0:T(8,128)(2,1)} parameter(0)",
        "  %b = bf16[256,512]{1,0:T(8,128)(2,1)} parameter(1)",
        "  %w = f32[256,256]{1,0:T(8,128)} parameter(2)", *body,
        "  ROOT %t = (bf16[128,512]{1,0:T(8,128)(2,1)}, f32[1024,256]{1,0:T(8,128)}) "
        "tuple(%mm, %g)", "}"])


def test_an_asynchronous_collective_overlaps_the_kernels_between_its_halves():
    gather = 0.75 * 1024 * 256 * 4 / V5E.ici_bytes_per_s
    matmul = (128 * 256 + 256 * 512 + 128 * 512) * 2 / V5E.hbm_bytes_per_s
    apart = predict_step_time(_gather_around_matmul(False), "v5e")
    assert apart["exposed_ici_s"] == pytest.approx(gather)
    assert apart["step_time_s"] == pytest.approx(gather + matmul)
    around = predict_step_time(_gather_around_matmul(True), "v5e")
    assert around["exposed_ici_s"] == pytest.approx(gather - matmul)
    assert around["step_time_s"] == pytest.approx(gather)
    assert around["ici_bytes_per_chip"] == apart["ici_bytes_per_chip"] == 0.75 * 1024 * 256 * 4


def _kernel_flops(results: str, operands: list[str]) -> float:
    """``attention_kernel_flops`` of a custom call with these result and operand shapes."""
    inst = hlo_program.Instruction("k", "custom-call", results,
                                   [f"x{i}" for i in range(len(operands))], "")
    return step_time.attention_kernel_flops(inst, {f"x{i}": s for i, s in enumerate(operands)})


@pytest.mark.parametrize("results, operands, products", [
    # splash attention's three kernels for 8 x 16 heads (8 kv heads) x 1024 x 64
    ("(bf16[8,8,2,1024,64], f32[8,8,2,1024,128])",
     ["bf16[8,8,2,1024,64]", "bf16[8,8,1024,64]", "bf16[8,8,1024,64]"], 2),
    ("(f32[8,8,512,64], bf16[8,8,2,1024,64])",
     ["bf16[8,8,2,1024,64]", "bf16[8,8,1024,64]", "bf16[8,8,1024,64]",
      "f32[8,8,2,1,1024]", "bf16[8,8,2,1024,64]"], 3),
    ("(bf16[8,8,1024,64], bf16[8,8,1024,64])",
     ["bf16[8,8,2,1024,64]", "bf16[8,8,1024,64]", "bf16[8,8,1024,64]",
      "bf16[8,8,2,1024,64]"], 4),
])
def test_attention_kernel_flops_from_its_shapes(results, operands, products):
    causal_product = 2 * 8 * 16 * 1024 * 1024 * 64 * step_time.CAUSAL_FRACTION
    assert _kernel_flops(results, operands) == products * causal_product


@pytest.mark.parametrize("results, operands, products", [
    # A context-parallel shard's kernels (one row: XLA drops its dimension): 2 kv heads x 4
    # query heads, the shard's 1024 queries against 2048 gathered keys, the tables first.
    ("(f32[2,512,128], f32[2,512,128], f32[2,512,64], bf16[2,4,1024,64], f32[2,4,1024,128])",
     ["s8[1,2,4]", "s8[1,2,4]", "bf16[2,4,1024,64]", "bf16[2,2048,64]", "bf16[2,2048,64]",
      "s32[1024,128]"], 2),
    ("(f32[2,512,64], bf16[2,4,1024,64])",
     ["s8[1,2,4]", "s8[1,2,4]", "bf16[2,4,1024,64]", "bf16[2,2048,64]", "bf16[2,2048,64]",
      "f32[2,4,1,1024]", "bf16[2,4,1024,64]", "f32[2,4,1,1024]", "s32[1024,128]"], 3),
    ("(f32[2,512,64], f32[2,512,64], bf16[2,2048,64], bf16[2,2048,64])",
     ["s8[1,2,4]", "s8[1,2,4]", "bf16[2,4,1024,64]", "bf16[2,2048,64]", "bf16[2,2048,64]",
      "f32[2,4,8,1024]", "bf16[2,4,1024,64]", "f32[2,4,8,1024]", "s32[8,1024]"], 4),
])
def test_attention_kernel_flops_of_a_shard_against_longer_keys(results, operands, products):
    """The shapes of a v5e step's kernels under context=2 (compiled for v5e:2x2)."""
    causal_product = 2 * 2 * 4 * 1024 * 2048 * 64 * step_time.CAUSAL_FRACTION
    assert _kernel_flops(results, operands) == products * causal_product


def test_an_unknown_chip_is_a_one_line_error():
    with pytest.raises(ValueError, match="no step-time rates for TPU generation 'v9'"):
        step_time.get_rates("v9:2x2")
