"""``tpu-train plan plan.chip=...`` with XLA's TPU compiler: the pod's topology, per-chip memory
and FLOPs with scanned layers counted per layer, and the fallback to the CPU compiler.

The compiling tests need libtpu (``pip install tpu_train[tpu]``; CI installs it) and compile a
small Llama for four v5e chips in this process (a few seconds each)."""

from __future__ import annotations

import pytest

from tpu_train.compile import targets
from tpu_train.models import flops_per_token, get_config, num_params
from tpu_train.planning import command, pod_topology
from tpu_train.planning.analysis import compiled_step_analysis
from tpu_train.planning import tpu_dump
from tpu_train.planning.loop_flops import loop_flops, while_loops
from tests.markers import needs_libtpu

# Large enough that matmuls are most of the FLOPs, small enough to compile in seconds.
SMALL = {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512,
         "ffn_hidden_dim": 768}
FSDP4 = dict(data=1, fsdp=4, tensor=1, batch=8, seq_len=128, overrides=SMALL)


@pytest.mark.parametrize("chip, chips, topology", [
    ("v5e", 256, "v5e:16x16"), ("v5e", 8, "v5e:2x4"), ("v5e", 1, "v5e:1x1"),
    ("v5p", 128, "v5p:4x4x8"), ("v5p", 4, "v5p:2x2x1"), ("v4", 64, "v4:4x4x4"),
    ("v5litepod", 16, "v5e:4x4"), ("v5p:2x4x4", 32, "v5p:2x4x4"),
])
def test_pod_topology_of_a_chip_count(chip, chips, topology):
    assert pod_topology(chip, chips) == topology


@pytest.mark.parametrize("chip, chips, message", [
    ("v5e:3x3", 8, "plan.chip='v5e:3x3' has 9 chips but the mesh"),
    ("v5e:2x2x2", 8, "a v5e topology has 2 non-zero dimensions"),
    ("v5e:2x", 8, "bad topology in TPU target 'v5e:2x'"),
    ("v9", 8, "unknown TPU generation"),
])
def test_bad_topology_is_a_one_line_error(chip, chips, message):
    with pytest.raises(ValueError, match=message) as error:
        command.choose_compiler(chip, chips)
    assert "\n" not in str(error.value)


def test_without_libtpu_the_cpu_compiler_is_used_and_said(monkeypatch):
    monkeypatch.setattr(command, "libtpu_available", lambda: False)
    target, note = command.choose_compiler("v5e", 256)
    assert target is None
    assert note.startswith("libtpu is not installed (pip install tpu_train[tpu]), so XLA's "
                           "TPU compiler cannot compile for v5e:16x16")
    assert command.choose_compiler("v7", 8) == (
        None, "XLA's TPU compiler here has no v7 target: XLA's figures are the CPU compiler's")
    assert command.choose_compiler(None, 8) == (None, None)


@needs_libtpu
def test_v5e_compiler_figures_with_scanned_layers_counted_per_layer(tmp_path):
    scanned = compiled_step_analysis("debug_tiny", scan_layers=True, target="v5e:2x2",
                                     dump_to=str(tmp_path), **FSDP4)
    assert scanned["compiler"] == "TPU" and scanned["compiled_for"] == "v5e:2x2"
    # What the plan command reads from the compiler's dump, before code generation, is what
    # the finished executable says, except the temporaries code generation adds.
    dumped, text = tpu_dump.dumped_figures(str(tmp_path))
    for key in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes"):
        assert dumped[key] == scanned[key], key
    assert 0 < dumped["temp_size_in_bytes"] <= scanned["temp_size_in_bytes"]
    assert dumped["bytes_peak_estimate"] - dumped["temp_size_in_bytes"] == \
        scanned["bytes_peak_estimate"] - scanned["temp_size_in_bytes"]
    assert dumped["flops_per_device"] == scanned["flops_per_device_raw"]
    assert loop_flops(text, dumped["flops_per_device"])["flops_per_device"] == \
        scanned["flops_per_device"]
    # The forward and the backward scans, each over the 4 layers.
    assert scanned["flops_per_device"] > 2 * scanned["flops_per_device_raw"]
    assert "2 loop bodies counted per iteration (4 x " in scanned["flops_note"]
    # The oracle: the TPU compiler's own count of the same step unrolled (no loops), where
    # XLA counts every layer. Scanned layers recompute a little (tpu_train.compile.layer_scan).
    unrolled = compiled_step_analysis("debug_tiny", scan_layers=False, target="v5e:2x2",
                                      **FSDP4)
    assert "flops_note" not in unrolled
    assert unrolled["flops_per_device"] == unrolled["flops_per_device_raw"]
    assert scanned["flops_per_device"] == pytest.approx(unrolled["flops_per_device"], rel=0.05)
    # And the model's count: 6 N per token plus attention, over 4 chips.
    cfg = get_config("debug_tiny", **SMALL)
    analytic = flops_per_token(cfg, 128) * 8 * 128 / 4
    assert scanned["flops_per_device"] == pytest.approx(analytic, rel=0.10)
    # Per-chip memory holds at least the FSDP shards of the parameters and AdamW's moments.
    assert scanned["argument_size_in_bytes"] >= 3 * 4 * num_params(cfg) / 4
    assert scanned["bytes_peak_estimate"] > scanned["argument_size_in_bytes"]
    # The step-time model walks the same programs: its kernels' matrix FLOPs, each loop body's
    # times its trips, are XLA's whole-program count less the elementwise FLOPs (under 2 %).
    for figures in (scanned, unrolled):
        predicted = figures["step_time"]
        assert 0.98 * figures["flops_per_device"] <= predicted["flops_per_chip"] \
            <= figures["flops_per_device"]
        # FSDP over 4 chips: every float32 weight is all-gathered and its gradient
        # reduce-scattered, 3/4 of it each way crossing the links, at the least.
        assert predicted["ici_bytes_per_chip"] >= 2 * 0.75 * 4 * num_params(cfg)
        assert predicted["dcn_bytes_per_chip"] == 0 and predicted["collectives_run"] > 0
        assert predicted["step_time_s"] >= sum(
            predicted[k] for k in ("compute_bound_s", "memory_bound_s", "vector_bound_s"))


@needs_libtpu
def test_two_slices_compile_and_only_gradient_reductions_cross_dcn():
    # data=2 across two slices of v5e:2x2, fsdp=4 inside each: a chip's gradient shard is
    # all-reduced with its twin in the other slice; the weights' all-gathers stay on ICI.
    two = compiled_step_analysis("debug_tiny", scan_layers=True, target="v5e:2x2",
                                 num_slices=2, **{**FSDP4, "data": 2})
    assert two["compiled_for"] == "v5e:2x2 x 2 slices"
    links = two["step_time"]["collectives_by_link"]
    assert set(links["dcn"]) == {"all-reduce"}
    assert "all-gather" in links["ici"]
    # A ring of two sends each chip's whole gradient shard once (float32, 1/4 of the model).
    shard = 4 * num_params(get_config("debug_tiny", **SMALL)) / 4
    assert shard <= two["step_time"]["dcn_bytes_per_chip"] <= 1.5 * shard
    assert two["step_time"]["exposed_dcn_s"] > 0


def test_loops_and_their_trip_counts_are_read_from_the_program():
    text = (
        "HloModule m\n\n"
        "%cond (p: (s32[], f32[])) -> pred[] {\n"
        "  %p = (s32[], f32[]) parameter(0)\n"
        "  %c = s32[]{:T(128)} constant(12)\n"
        "  %i = s32[] get-tuple-element(%p), index=0\n"
        "  ROOT %lt = pred[] compare(%i, %c), direction=LT\n}\n\n"
        "%body (p: (s32[], f32[])) -> (s32[], f32[]) {\n"
        "  ROOT %p = (s32[], f32[]) parameter(0)\n}\n\n"
        "ENTRY %main (a: (s32[], f32[])) -> (s32[], f32[]) {\n"
        "  %a = (s32[], f32[]) parameter(0)\n"
        "  ROOT %w = (s32[], f32[]) while(%a), condition=%cond, body=%body\n}\n")
    assert while_loops(text) == [("body", 12)]
    assert while_loops(text.replace("direction=LT", "direction=NE")) == [("body", None)]


@needs_libtpu
def test_a_topology_libtpu_rejects_stops_the_plan_in_one_line():
    # Well formed and the mesh's size, but no such slice: the analysis child's libtpu says so.
    from tests.trainer.cli_helpers import run_in_process

    code, out, err = run_in_process("plan", "model=debug_tiny", "parallel.data=9",
                                    "plan.chip=v5e:3x3")
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "tpu-train: error: TPU target 'v5e:3x3': libtpu cannot build it ("), err


@needs_libtpu
def test_the_plan_reads_the_buffer_assignment_as_a_lower_bound_by_default(tmp_path):
    from tests.test_cli_plan import plan

    code, out, err, result = plan(tmp_path, "plan", "model=debug_tiny", "parallel.fsdp=4",
                                  "data.seq_len=32", "plan.chip=v5e")
    assert code == 0, err
    assert "compile_until_buffer_assignment" in result["xla"]["seconds"]
    assert "XLA (TPU compiler, v5e:2x2, at its buffer assignment): " in out
    assert "memory: read before code generation, a lower bound" in out
    assert "plan.fast=false compiles the executable" in out
    # The verdict adds to that lower bound the most the executable has needed beyond it.
    assert result["verdict"]["needed_bytes"] == pytest.approx(
        result["xla"]["bytes_peak_estimate"] * 1.07)
    assert result["fits"] and "its buffer assignment + 7 % (the most the compiler's own total" \
        in out
    # The step time read from the same program, with where it goes and its basis.
    predicted = result["xla"]["step_time"]
    assert 0 < predicted["mfu"] < 1 and predicted["tokens_per_s_per_chip"] > 0
    assert f"step time predicted from the compiled program: " \
           f"{1e3 * predicted['step_time_s']:.1f} ms, MFU {100 * predicted['mfu']:.1f} %" in out
    assert "  where it goes: compute-bound kernels " in out
    assert "cloud.google.com/tpu/docs/v5e" in out


# libtpu's account of a compile (v5e, the default job's step), as its INFO log has it.
_LOG = """I1205 14:10:03.593793 7546 deepsea_compiler_backend.cc:2127] XLA::TPU program HBM usage: 41.68M / 15.75G
I1205 14:10:03.593825 7546 deepsea_compiler_backend.cc:2171] Total hbm usage >= 338.79M:
    reserved        258.00M
    program          41.68M
    arguments        39.10M

Output size 39.03M; shares 39.03M with arguments.

Total host usage >= 0B:
    reserved             0B
"""


def test_the_compilers_total_is_read_from_its_log(tmp_path):
    from tpu_train.planning import compiler_log

    MiB = 2**20
    assert compiler_log.parse_total_hbm(_LOG) == {"total": int(338.79 * MiB),
                                                  "reserved": int(258.00 * MiB)}
    # The last compile's block where a log holds several; none where it has no such line.
    later = _LOG.replace("338.79M", "20.15G").replace("258.00M", "263.06M")
    assert compiler_log.parse_total_hbm(_LOG + later) == {"total": int(20.15 * 2**30),
                                                          "reserved": int(263.06 * MiB)}
    assert compiler_log.parse_total_hbm("I1205 nothing here") is None
    assert compiler_log.total_hbm_bytes(str(tmp_path)) is None  # no log written
    (tmp_path / compiler_log.LOG_NAME).write_text(_LOG)
    assert compiler_log.total_hbm_bytes(str(tmp_path))["total"] == int(338.79 * MiB)
    env = compiler_log.log_env(str(tmp_path), {"LIBTPU_INIT_ARGS": "--xla_foo=1"})
    assert env["TPU_LOG_DIR"] == str(tmp_path) and env["TPU_MIN_LOG_LEVEL"] == "0"
    assert env["LIBTPU_INIT_ARGS"] == "--xla_foo=1 --logbuflevel=-1"


@needs_libtpu
def test_a_loop_nested_in_a_loop_body_is_counted_per_iteration_of_both():
    """Two scans, one inside the other's body (blockwise attention inside a scanned layer has
    this shape), compiled for a v5e: every matmul counted as often as it runs, 5 x (1 + 7)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    n = 256

    def program(x, w):
        def outer(c, _):
            def inner(d, _):
                return jnp.tanh(d @ w), None
            d, _ = jax.lax.scan(inner, c, None, length=7)
            return d @ w, None
        return jax.lax.scan(outer, x, None, length=5)[0]

    device = targets.resolve_target("v5e:1x1").devices[0]
    spec = jax.ShapeDtypeStruct((n, n), jnp.float32, sharding=SingleDeviceSharding(device))
    compiled = jax.jit(program).lower(spec, spec).compile()
    text = compiled.as_text()
    assert sorted(trips for _, trips in while_loops(text)) == [5, 7]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    figures = loop_flops(text, cost["flops"])
    matmuls = 5 * (1 + 7) * 2 * n ** 3
    elementwise = 5 * 7 * n * n * 4  # tanh, at most a few FLOPs an element
    assert matmuls <= figures["flops_per_device"] <= matmuls + elementwise
    assert "1 loop(s) nested in them" in figures["flops_note"]
