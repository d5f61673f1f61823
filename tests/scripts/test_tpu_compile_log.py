"""scripts/tpu_compile_log.py reads libtpu's compile log: stage durations in libtpu's units, the
bundle count and fingerprint, and each kernel's backend time on the thread that compiled it
(worker threads interleave; the program's own code waits for the kernels and is left out).
scripts/tpu_compile.py --compile-log points libtpu's log at a fresh directory."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import tpu_compile  # noqa: E402
import tpu_compile_log  # noqa: E402

# Lines as libtpu 0.0.42.1 writes them (one compile of the default job's step, shortened).
LOG = """\
Log line format: [IWEF]mmdd hh:mm:ss.uuuuuu threadid file:line] msg
I1205 02:13:51.341753   14709 deepsea_compiler_hlo_passes.cc:6091] Initial HLO module: jit_program instructions: 2,321 fingerprint: 
I1205 02:13:52.457319   14709 deepsea_compiler_hlo_passes.cc:6241] HLO_PASSES stage duration: 1.115558929s
I1205 02:13:53.435791   14817 deepsea_compiler_backend.cc:3769] [slice.56] LLO optimizing 25 instructions
I1205 02:13:53.437151   14817 deepsea_compiler_backend.cc:2846] post-bundle-packing non-empty bundle count: 11
I1205 02:13:53.439768   14817 deepsea_compiler_backend.cc:3769] [multiply_reduce_fusion.32] LLO optimizing 171,288 instructions
I1205 02:13:53.440697   14816 deepsea_compiler_backend.cc:3769] [bitcast_clamp_fusion] LLO optimizing 31 instructions
I1205 02:13:53.464300   14814 deepsea_compiler_backend.cc:3769] [<no-hlo-instruction>] LLO optimizing 37,495 instructions
I1205 02:13:53.940697   14816 deepsea_compiler_backend.cc:3769] [fusion.161] LLO optimizing 83,411 instructions
I1205 02:14:00.000000   14816 lsra_v2.cc:256] LSRAv2 *** total allocation time: 2.37 s (2370000 us) (cumulative: 3 s, max: 2.37 s, #called: 4)
I1205 02:14:01.940697   14816 deepsea_compiler_backend.cc:2846] post-bundle-packing non-empty bundle count: 9448
I1205 02:14:10.289768   14817 deepsea_compiler_backend.cc:2846] post-bundle-packing non-empty bundle count: 18091
I1205 02:15:06.882353   14814 live_range_finder.cc:67] LSRAv2 ConstructLiveRanges time: 2.63 ms (2630 us) (cumulative: 3.53 s, max: 346 ms, #called: 405)
I1205 02:15:07.467064   14813 deepsea_compiler_base.cc:3931] BACKEND_PASSES stage duration: 1m14.36838575475s
I1205 02:15:12.581899   14813 deepsea_compiler_backend.cc:1773] final program bundle count: 522,453 note this count does not reflect cycles spent executing delays.
I1205 02:15:12.932069   14813 deepsea_compiler_backend.cc:1488] CODE_GENERATION stage duration: 5.4647365395s
I1205 02:15:13.245428   14813 isa_program_util_common.cc:373] (HLO module jit_program): Executable fingerprint:853cc07432f48fa2b439f9f970ab98783ec5b354184ac21fbaf82c17b8127f3d
I1205 02:15:13.245430   14813 isa_program_util_common.cc:377] (HLO module jit_program): Executable fingerprint (including data segments):10f66c9dba1543ce4c3be1b9f165e95c53237d9a02727a2839fd8abcb39356b5
I1205 02:15:13.246989   14709 deepsea_compiler_base.cc:985] END_TO_END stage duration: 1m21.91084854675s
"""


def test_stages_bundles_and_fingerprint():
    summary = tpu_compile_log.summarize(LOG)
    assert summary["stages_s"] == {"hlo_passes": 1.12, "backend_passes": 74.37,
                                   "code_generation": 5.46, "end_to_end": 81.91}
    assert summary["bundles"] == 522453
    assert summary["executable_fingerprint"] == \
        "853cc07432f48fa2b439f9f970ab98783ec5b354184ac21fbaf82c17b8127f3d"


def test_each_kernel_is_timed_on_its_own_thread():
    summary = tpu_compile_log.summarize(LOG, top=2)
    # fusion.32: thread 14817 from 53.439768 to its last line at 02:14:10.289768; fusion.161:
    # thread 14816 from 53.940697 to 02:14:01.940697; slice.56 until its thread's next kernel.
    assert summary["top_kernels"] == [["multiply_reduce_fusion.32", 171288, 16.85],
                                      ["fusion.161", 83411, 8.0]]
    assert summary["kernels"] == 4  # the program's own code is not a kernel
    assert summary["kernels_backend_s"] == pytest.approx(16.85 + 8.0 + 0.5 + 0.004, abs=0.05)
    assert summary["top_kernels_share"] == pytest.approx(24.85 / 25.35, abs=0.01)


def test_a_log_without_kernel_names_still_gives_the_stages():
    lines = [line for line in LOG.splitlines() if "LLO optimizing" not in line]
    summary = tpu_compile_log.summarize("\n".join(lines))
    assert summary["kernels"] == 0 and summary["top_kernels_share"] is None
    assert summary["stages_s"]["backend_passes"] == 74.37


@pytest.mark.parametrize("text, seconds", [("1m14.36838575475s", 74.36838575475),
                                           ("780.1094605ms", 0.7801094605), ("2s", 2.0),
                                           ("1h2m3s", 3723.0)])
def test_durations_in_libtpu_units(text, seconds):
    assert tpu_compile_log.duration_seconds(text) == pytest.approx(seconds)


def test_a_duration_in_another_unit_is_refused():
    with pytest.raises(ValueError, match="not a libtpu duration"):
        tpu_compile_log.duration_seconds("3 fortnights")


def test_compile_log_points_libtpu_at_a_new_directory_and_keeps_its_arguments():
    environ = {"LIBTPU_INIT_ARGS": "--xla_jf_lsra_log_timings=true"}
    log_dir = tpu_compile.enable_compile_log(environ)
    assert Path(log_dir).is_dir() and environ["TPU_LOG_DIR"] == log_dir
    assert environ["LIBTPU_INIT_ARGS"] == \
        "--xla_jf_lsra_log_timings=true --vmodule=deepsea_compiler_backend=2 --logbuflevel=-1"
    assert tpu_compile.read_compile_log(log_dir, wait_s=0.3) is None  # nothing compiled yet
    (Path(log_dir) / "tpu_driver.INFO").write_text(LOG)
    assert tpu_compile.read_compile_log(log_dir)["bundles"] == 522453
    Path(log_dir, "tpu_driver.INFO").unlink()
    Path(log_dir).rmdir()


def test_the_log_is_read_once_the_compile_has_ended(tmp_path, monkeypatch):
    """libtpu writes its last lines after the compile returns: the reader waits for them."""
    head, tail = LOG.split("I1205 02:15:12.932069", 1)
    log = tmp_path / "tpu_driver.INFO"
    log.write_text(head)
    sleeps = []

    def finish_writing(seconds):
        sleeps.append(seconds)
        log.write_text(head + "I1205 02:15:12.932069" + tail)

    monkeypatch.setattr(tpu_compile.time, "sleep", finish_writing)
    summary = tpu_compile.read_compile_log(str(tmp_path))
    assert len(sleeps) == 1 and summary["stages_s"]["end_to_end"] == 81.91
    assert summary["executable_fingerprint"].startswith("853cc074")


# An optimized program's text (shortened): the entry computation, one while loop whose body
# calls a fused computation, and a conditional branch inside the body.
HLO = """\
HloModule jit_program, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_computation.1 (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %multiply.9 = f32[4]{0} multiply(%param_0, %param_0)
}

%branch (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %slice.56 = f32[4]{0} negate(%p)
}

%body (arg: (s32[], f32[4])) -> (s32[], f32[4]) {
  %arg = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%arg), index=1
  %fusion.161 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation.1
  %cond.1 = f32[4]{0} conditional(%i, %fusion.161), branch_computations={%branch}
  ROOT %tuple = (s32[], f32[4]{0}) tuple(%i, %cond.1)
}

%condition (arg: (s32[], f32[4])) -> pred[] {
  %arg = (s32[], f32[4]{0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main.9 (Arg_0.1: f32[4]) -> f32[4] {
  %Arg_0.1 = f32[4]{0} parameter(0)
  %multiply_reduce_fusion.32 = f32[4]{0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_computation.1
  %while.3 = (s32[], f32[4]{0}) while(%tuple.1), condition=%condition, body=%body
  ROOT %bitcast_clamp_fusion = f32[4]{0} get-tuple-element(%while.3), index=1
}
"""


def test_kernels_are_summed_by_part_of_the_program():
    parts = tpu_compile_log.kernels_by_computation(LOG, HLO)
    # multiply_reduce_fusion.32 and bitcast_clamp_fusion sit in the entry; fusion.161 in the
    # loop's body, slice.56 in a branch the body calls.
    assert list(parts) == ["entry", "loop 1"]
    assert parts["entry"] == {"kernels": 2, "llo_instructions": 171288 + 31,
                              "backend_s": pytest.approx(16.85 + 0.5, abs=0.01)}
    assert parts["loop 1"]["kernels"] == 2
    assert parts["loop 1"]["llo_instructions"] == 83411 + 25


def test_hlo_dir_gets_the_input_and_the_optimized_program(tmp_path):
    class Text:
        def __init__(self, text):
            self.text = text

        def as_text(self):
            return self.text

    args = tpu_compile.argparse.Namespace(hlo_dir=str(tmp_path / "hlo"), program="jax_scan")
    tpu_compile.write_hlo(args, Text("module @jit_step"), Text(HLO))
    assert (tmp_path / "hlo" / "jax_scan.stablehlo.mlir").read_text() == "module @jit_step"
    assert (tmp_path / "hlo" / "jax_scan.optimized.hlo").read_text() == HLO
