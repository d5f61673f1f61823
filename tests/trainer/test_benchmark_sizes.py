"""The benchmark sizes through ``tpu-train``: ``model=llama_w1|llama_350m|llama_1b`` are the
shapes and settings ``scripts/bench_train_step.py --size`` measures, and a run on
``data=synthetic_tokens`` reports the steady rate that ``scripts/bench_cli_sizes.py`` compares."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

from tests.trainer.cli_helpers import one_thread, read_metrics, run_in_process  # noqa: F401
from tpu_train.models import CONFIGS, flops_per_token, get_config
from tpu_train.trainer.metrics import PEAK_BF16_TFLOPS, chip_name

ROOT = Path(__file__).resolve().parents[2]
SIZES = ("w1", "350m", "1b")


def _load_script(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve their module by name
        spec.loader.exec_module(module)
    return sys.modules[name]


jax_llama = _load_script("jax_llama")
bench_cli_sizes = _load_script("bench_cli_sizes")


@pytest.mark.parametrize("size", SIZES)
def test_preset_is_the_benchmarked_shape(size):
    assert get_config(f"llama_{size}") == jax_llama.SIZES[size].config()


@pytest.mark.parametrize("size", SIZES)
def test_command_gets_the_benchmarks_settings(size):
    """The config the command composes equals the one the benchmark's step is built from in
    everything that shapes a step (trainer, optimizer, mesh), and carries the size's batch."""
    assert bench_cli_sizes.settings_differ(size, steps=10) == {}


def test_settings_differ_names_a_difference():
    differ = bench_cli_sizes.settings_differ  # the check above must be able to fail
    saved = bench_cli_sizes.cli_overrides
    try:
        bench_cli_sizes.cli_overrides = lambda *a: [*saved(*a), "trainer.max_grad_norm=2.0",
                                                    "data.batch_size=2"]
        assert differ("w1", steps=10) == {"trainer.max_grad_norm": [2.0, 1.0],
                                          "data.batch_size": [2, 4]}
    finally:
        bench_cli_sizes.cli_overrides = saved


@pytest.mark.usefixtures("one_thread")
def test_w1_of_one_layer_trains_on_synthetic_tokens(monkeypatch, tmp_path):
    """A shallower w1 (1 layer, to keep the compile short) through the command line, compiled:
    random ids of its vocabulary, and the closing block's steady figures, which the benchmark
    script reads back. The session's 8 devices take one row each (the size's batch is 4)."""
    monkeypatch.setitem(CONFIGS, "llama_w1", dataclasses.replace(CONFIGS["llama_w1"], n_layers=1))
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(
        "recipe=llama_pretrain", "model=llama_w1", "data=synthetic_tokens",
        "trainer.max_steps=3", "data.batch_size=8", f"run.dir={run_dir}",
        "checkpoint.export_hf=false", "logging.progress_bar=false")
    assert code == 0, err
    # Embedding and head 2 x 8192 x 512, one layer 2 x 512^2 + 2 x 512 x 256 + 3 x 512 x 1408,
    # three norms of 512: 11,339,264.
    assert "model: llama_w1, 11.3 M parameters" in out
    assert "global batch 8 x 256 tokens" in out and "precision: bf16 compute" in out
    rows = read_metrics(run_dir)
    # Uniform random targets: a near-uniform fresh model's loss is about ln(vocab).
    assert abs(rows[1]["train/loss"] - math.log(8192)) < 0.25, rows[1]
    throughput = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if "throughput/tokens_per_s" in line]
    assert len(throughput) == 1 and throughput[0]["step"] == 3
    steady = [rows[2]["train/step_time_s"], rows[3]["train/step_time_s"]]
    figures = bench_cli_sizes.read_throughput(run_dir)
    assert figures["timed_steps"] == 2
    assert figures["median_step_s"] == pytest.approx(statistics.median(steady), rel=1e-12)
    assert figures["tokens_per_s"] == pytest.approx(8 * 256 / figures["median_step_s"], rel=1e-12)
    assert figures["first_step_s"] == rows[1]["train/step_time_s"]
    assert 0 < figures["wall_tokens_per_s"] <= figures["tokens_per_s"] * 1.01
    assert "over 2 steps (the first, which compiled, not counted)" in out
    # Training FLOPs per token, 6 x the weights in matmuls (the layer's 2,949,120 above and the
    # head's 8192 x 512) + 12 x layers x dim x seq_len for the attention products (PaLM, app. B).
    flops = 6 * (2_949_120 + 8192 * 512) + 12 * 1 * 512 * 256
    assert flops_per_token(CONFIGS["llama_w1"], 256) == flops
    # MFU against the chip's published peak where it has one (a TPU), none on the CPU client.
    from tpu_train.device import runtime

    chip = chip_name(runtime.jax_device(0).device_kind)
    if chip is None:
        assert figures["mfu"] is None
        mfu = "MFU unknown"
    else:
        expected = figures["tokens_per_s"] * flops / (PEAK_BF16_TFLOPS[chip] * 1e12)
        assert figures["mfu"] == pytest.approx(expected, rel=1e-12)
        mfu = f"MFU {expected:.1%}"
    assert f"{figures['tokens_per_s']:,.0f} tokens/s at the median step, {mfu}" in out


@pytest.mark.usefixtures("one_thread")
def test_one_step_has_no_steady_rate(tmp_path):
    from tests.trainer.cli_helpers import TINY

    code, out, err = run_in_process(*TINY, "data=synthetic_tokens", "trainer.max_steps=1",
                                    f"run.dir={tmp_path / 'run'}")
    assert code == 0, err
    assert "throughput: not measured: the run took one step" in " ".join(out.split())
    assert "throughput/" not in (tmp_path / "run" / "metrics.jsonl").read_text()


@pytest.mark.usefixtures("one_thread")
def test_synthetic_tokens_resume_exactly(tmp_path):
    """A run on random tokens stopped at step 2 and resumed to 4 sees the batches, and so the
    losses, of an uninterrupted 4-step run (the checkpoint holds the stream's position)."""
    from tests.trainer.cli_helpers import TINY

    common = [*TINY, "data=synthetic_tokens", "checkpoint.every_n_steps=2"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert run_in_process(*common, "trainer.max_steps=4", f"run.dir={whole}")[0] == 0
    assert run_in_process(*common, "trainer.max_steps=2", f"run.dir={split}")[0] == 0
    code, _, err = run_in_process(*common, "trainer.max_steps=4", "scheduler.extend=true",
                                  f"run.dir={split}")
    assert code == 0, err
    losses = {name: [read_metrics(d)[step]["train/loss"] for step in range(1, 5)]
              for name, d in (("whole", whole), ("split", split))}
    assert losses["whole"] == losses["split"]
    assert len(set(losses["whole"])) == 4
