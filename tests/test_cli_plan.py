"""``tpu-train plan``: analytic per-chip memory beside XLA's analysis of the compiled step.

A debug_tiny Llama on an FSDP=8 mesh: the child process compiles the real SPMD step for
abstract inputs, with XLA's TPU compiler for eight v5e chips (``v5e:2x4``) where libtpu is
installed, else on 8 virtual CPU devices, so the test checks the whole path (Hydra config →
planning config → subprocess → XLA memory analysis → report) in well under a minute.
"""

from __future__ import annotations

import json

import pytest

from tests.trainer.cli_helpers import run_in_process
from tpu_train.compile.targets import libtpu_available
from tests.trainer.hf_checkpoint import custom_llama  # noqa: F401 (a fixture)

PLAN = ["plan", "model=debug_tiny", "parallel.fsdp=8", "data.seq_len=32", "plan.chip=v5e",
        "plan.fast=false"]  # the executable's figures


def plan(tmp_path, *overrides: str) -> tuple[int, str, str, dict | None]:
    """``tpu-train <overrides> plan.output=...``: status, output, and the JSON it wrote."""
    output = tmp_path / f"plan_{len(list(tmp_path.glob('plan_*.json')))}.json"
    code, out, err = run_in_process(*overrides, f"plan.output={output}")
    if code == 0:
        assert out.strip().splitlines()[-1] == f"plan written to {output} (every figure, JSON)"
    return code, out, err, json.loads(output.read_text()) if output.exists() else None


@pytest.mark.timeout(240)
def test_plan_reports_analytic_and_xla_memory(tmp_path):
    code, out, err, result = plan(tmp_path, *PLAN, "trainer.scan_layers=true")
    assert code == 0, err
    assert result["mesh"]["fsdp"] == 8 and result["num_devices"] == 8
    # The default global batch of 8 splits over 8 chips: nothing was adjusted.
    assert result["batch"] == 8 and not any("batch_size" in n for n in result["notes"])
    xla = result["xla"]
    assert xla["xla_source"] == "compiled PyTorch step", xla
    if libtpu_available():
        assert xla["compiler"] == "TPU" and xla["compiled_for"] == "v5e:2x4", xla
        assert "XLA (TPU compiler, v5e:2x4): " in out and "note:" not in out
    else:
        assert xla["compiler"] == "CPU" and result["notes"][0].startswith("libtpu is not")
        assert "XLA (CPU compiler, 8 virtual CPU devices): " in out
    # The 4 layers are scanned: the forward and backward scans counted per layer.
    assert xla["flops_per_device"] > 2 * xla["flops_per_device_raw"]
    assert result["xla_flops_vs_analytic"] == pytest.approx(
        xla["flops_per_device"] / result["hardware_flops_per_chip"] - 1)
    # XLA holds at least the step's own sharded parameters and AdamW moments per chip.
    assert xla["argument_size_in_bytes"] >= result["bytes_params"] + result["bytes_optimizer"]
    if libtpu_available():
        # The TPU compiler's own total from its log (program, code and arguments, less what
        # the runtime reserves) is what the analytic figure is compared with.
        step_bytes = xla["compiler_total_hbm_bytes"] - xla["compiler_reserved_hbm_bytes"]
        assert 0 < xla["compiler_reserved_hbm_bytes"] < xla["compiler_total_hbm_bytes"]
        assert step_bytes >= xla["argument_size_in_bytes"]
        assert "GiB per chip by the compiler's own total (its log: " in out
    else:
        step_bytes = xla["bytes_peak_estimate"]
    assert result["xla_vs_analytic"] == pytest.approx(step_bytes / result["bytes_total"] - 1)
    assert result["chip"] == "v5e" and result["fits"] and result["fits_analytic"]
    assert "XLA vs analytic per chip: memory " in out
    # One verdict, by XLA's TPU compiler's own total where it compiled the step.
    verdicts = [line for line in out.splitlines() if "FIT" in line]
    assert len(verdicts) == 1 and verdicts[0].startswith("verdict: FITS on v5e: "), out
    if libtpu_available():
        assert result["verdict"]["needed_bytes"] == step_bytes
        assert verdicts[0].endswith("by XLA's TPU compiler for v5e:2x4, the compiled step's "
                                    "own total")
    else:
        assert result["verdict"]["needed_bytes"] == result["bytes_total"]
        assert "by the analytic estimate (XLA's figures are the CPU compiler's" in verdicts[0]
    assert result["fitting"] == []


@pytest.mark.timeout(240)
def test_plan_of_a_bf16_step(tmp_path):
    """trainer.precision=bf16 (the benchmark sizes' model options carry it) reaches the
    analysis child, which compiles the bf16 step: another program than the fp32 one (on the
    CPU compiler a larger one, with the bf16 copies of the weights beside the fp32 ones)."""
    base = ["plan", "model=debug_tiny", "parallel.fsdp=8", "data.seq_len=32"]
    figures = {}
    for precision in ("fp32", "bf16"):
        code, out, err, figures[precision] = plan(tmp_path, *base,
                                                  f"trainer.precision={precision}")
        assert code == 0, err
        assert "xla_error" not in figures[precision], figures[precision]
    peaks = {precision: plan["xla"]["bytes_peak_estimate"] for precision, plan in figures.items()}
    assert peaks["bf16"] != peaks["fp32"], peaks


def test_plan_raises_a_batch_that_does_not_split():
    # Analytic only would need no XLA; the batch note is decided before any compile.
    from omegaconf import OmegaConf

    from tpu_train.planning import planning_config

    cfg = OmegaConf.create({"parallel": {"data": -1, "fsdp": 256, "tensor": 1},
                            "data": {"batch_size": 8}})
    planned, notes = planning_config(cfg)
    assert planned.parallel.data == 1 and planned.data.batch_size == 256
    assert len(notes) == 1 and "data.batch_size=8" in notes[0]


@pytest.mark.parametrize("overrides, expected", [
    (["parallel.fsdp=3"], "fsdp"),
    (["plan.chip=v9"], "unknown TPU generation 'v9'"),
    (["parallel.tensor=3"], "tensor"),
    (["plan.chip=v5e:2x2"], "plan.chip='v5e:2x2' has 4 chips but the mesh"),
    (["plan.chip=v5e:4"], "a v5e topology has 2 non-zero dimensions"),
])
def test_plan_bad_input_is_one_line(overrides, expected):
    code, out, err = run_in_process("plan", "model=debug_tiny", *overrides)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpu-train: error: "), err
    assert expected in lines[0], lines[0]


@pytest.mark.timeout(240)
def test_plan_takes_the_architecture_of_model_checkpoint(custom_llama, tmp_path):
    """A Hugging Face checkpoint of no preset size is planned as the trainer would build it."""
    from tpu_train.models import Llama, read_config

    checkpoint = custom_llama
    code, out, err, result = plan(tmp_path, "plan", f"model.checkpoint={checkpoint}",
                                  "data.seq_len=32", "data.batch_size=2")
    assert code == 0, err
    import torch

    with torch.device("meta"):
        model = Llama(read_config(checkpoint)[1])
    assert result["num_params"] == sum(p.numel() for p in model.parameters())
    assert result["xla"]["xla_source"] == "compiled PyTorch step", result["xla"]
    # XLA's arguments hold the checkpoint-sized parameters and AdamW moments, not debug_tiny's.
    assert result["bytes_params"] + result["bytes_optimizer"] <= result["xla"][
        "argument_size_in_bytes"] < 2 * (result["bytes_params"] + result["bytes_optimizer"])


def test_recipe_plan_is_the_plan_command(monkeypatch):
    """``tpu-train recipe=plan ...`` and ``tpu-train plan ...`` run the plan on the same config
    (the plan itself is replaced by a recorder: test_plan_reports_analytic_and_xla_memory runs
    the real one)."""
    from omegaconf import OmegaConf

    from tpu_train.planning import command as plan_command

    code, out, err = run_in_process("recipe=plan", "model=debug_tiny", "parallel.fsdp=3")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "fsdp" in err, err
    seen = []
    monkeypatch.setattr(plan_command, "plan_job",
                        lambda cfg: seen.append(OmegaConf.to_container(cfg, resolve=False)))
    overrides = ["model=debug_tiny", "parallel.fsdp=8", "plan.chip=v5e"]
    for command in (["plan", *overrides], ["recipe=plan", *overrides],
                    [*overrides, "recipe=plan"]):
        code, out, err = run_in_process(*command)
        assert code == 0, err
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]
    assert seen[0]["parallel"]["fsdp"] == 8 and seen[0]["plan"]["chip"] == "v5e"


def _analysing_each_setting_once(monkeypatch) -> list[str]:
    """XLA's analysis of a plan (a child process that compiles the step) is a function of the
    settings it is given: record each one's, and hand a setting analysed before its recorded
    figures. Returns the keys of the settings that were read back from the record."""
    from tpu_train.planning import command

    analysed, reused = {}, []
    real = command.analyse_in_child

    def analyse_in_child(args, **options):
        key = repr((sorted(args.items()), sorted(options.items())))
        if key in analysed:
            reused.append(key)
        else:
            analysed[key] = real(args, **options)
        return analysed[key]

    monkeypatch.setattr(command, "analyse_in_child", analyse_in_child)
    return reused


@pytest.mark.timeout(900)
def test_a_plan_that_does_not_fit_names_a_command_line_that_does(tmp_path, monkeypatch):
    """8,192 rows of 256 tokens on eight v5e chips need more than a chip's HBM (with libtpu,
    XLA's TPU compiler stops with an out-of-memory error after its buffer assignment, whose
    figures the plan reads). The plan says so once and prints tpu-train command lines that
    would fit; the first, run as printed, fits: it asks XLA for the very setting the plan
    compiled to check it, whose figures are not compiled a second time, and whose predicted
    step time and MFU the suggestion carries."""
    import shlex

    reused = _analysing_each_setting_once(monkeypatch)
    code, out, err, result = plan(tmp_path, "plan", "model=debug_tiny", "parallel.fsdp=8",
                                  "plan.chip=v5e", "data.batch_size=8192")
    assert reused == []  # the plan and each of its checks: another setting each
    assert code == 0, err
    assert not result["fits"] and result["verdict"]["needed_bytes"] > \
        result["verdict"]["usable_bytes"]
    verdicts = [line for line in out.splitlines() if "FIT" in line]
    assert len(verdicts) == 1 and verdicts[0].startswith("verdict: DOES NOT FIT on v5e: "), out
    if libtpu_available():
        assert "by XLA's TPU compiler for v5e:2x4" in verdicts[0]
    lines = out.splitlines()
    suggested = lines[lines.index("  settings that would fit:") + 1].strip()
    command, _, how = suggested.partition("   # ")
    assert how.startswith("XLA: fits, " if libtpu_available() else "estimated ~"), suggested
    args = shlex.split(command)
    assert args[:3] == ["tpu-train", "plan", "model=debug_tiny"]
    # What the planner filled in is spelt out: the model's context and the mesh it counted.
    assert "data.seq_len=256" in args and "data.batch_size=8192" in args
    code, out, err, checked = plan(tmp_path, *args[1:])
    assert code == 0, err
    assert len(reused) == 1  # the printed line is the setting whose check fitted
    assert checked["fits"] and checked["verdict"]["basis"] == result["verdict"]["basis"]
    if libtpu_available():  # the setting that fits comes with its own predicted step time
        predicted = checked["xla"]["step_time"]
        assert result["fitting"][0]["checked_mfu"] == pytest.approx(predicted["mfu"])
        assert f"MFU {100 * predicted['mfu']:.1f} %" in how, suggested
    assert [line for line in out.splitlines() if "FIT" in line][0].startswith(
        "verdict: FITS on v5e: ")


def test_the_plan_takes_the_models_context_where_data_seq_len_is_not_given():
    """The bundled corpus's 128 tokens say nothing of a pod run: without data.seq_len on the
    command line the plan takes the model's context, at most 4,096 tokens, and says so."""
    from tests.compile.test_out_of_memory import _config
    from tpu_train.planning import planning_config

    config = _config("model=llama3_1_8b", "parallel.fsdp=256")
    assert config.data.seq_len == 128
    planned, notes = planning_config(config, seq_len_given=False)
    assert planned.data.seq_len == 4096
    assert notes[0].startswith("data.seq_len not set: planning 4,096 tokens a sequence (the "
                               "model's context, 131,072, at most 4,096;")
    planned, notes = planning_config(_config("model=debug_tiny"), seq_len_given=False)
    assert planned.data.seq_len == 256  # debug_tiny's context
    planned, notes = planning_config(config)  # given: as it is
    assert planned.data.seq_len == 128 and not any("seq_len" in n for n in notes)


def test_a_command_line_with_changes_replaces_their_keys():
    from tpu_train.planning.command import command_line

    line = command_line(["model=llama3_1_8b", "parallel.fsdp=256", "+trainer.remat=save_dots",
                         "plan.chip=v5e"],
                        {"trainer.remat": "full", "trainer.micro_batch_size": None,
                         "data.seq_len": 4096})
    assert line == ("tpu-train plan model=llama3_1_8b parallel.fsdp=256 plan.chip=v5e "
                    "trainer.remat=full trainer.micro_batch_size=null data.seq_len=4096")


def test_the_plan_is_written_under_runs_plan_by_default(monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    from tpu_train.planning.command import _output_path, write_plan

    monkeypatch.chdir(tmp_path)
    path = _output_path(OmegaConf.create({"plan": {"output": None}}))
    assert path.parent.parent == tmp_path.relative_to(tmp_path) / "runs" / "plan"
    write_plan({"fits": True}, path)
    path.parent.mkdir(exist_ok=True)
    assert _output_path(OmegaConf.create({"plan": {}})) != path  # a new folder each time
    assert json.loads(path.read_text()) == {"fits": True}
    assert not list(path.parent.glob("*.partial"))
    chosen = tmp_path / "mine"
    chosen.mkdir()
    assert _output_path(OmegaConf.create({"plan": {"output": str(chosen)}})) == \
        chosen / "plan.json"
