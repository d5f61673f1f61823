"""``tpu-train ... parallel.context=N``: sequences split over devices in the compiled step.

The reference is the same command on ONE device, in a child process whose JAX sees a single CPU
device. The context-parallel runs split each sequence over 2 or 4 of this session's 8 virtual
devices, with FSDP or tensor parallelism on the rest, and must train the same model: the
tokens are permuted into the zig-zag layout inside the program, which neither the loss (a sum
over tokens) nor the gradients see, so the losses agree to float rounding.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch

from tpu_train.ops.context_attention import KEY_BLOCK

from tests.platforms import cpu_child_env
from tests.tolerances import loss_rtol
from tests.trainer.cli_helpers import read_metrics, run_in_process

STEPS = 3
SEQ = 256
LONG_SEQ = 4096


def _common(seq: int) -> list[str]:
    return ["recipe=llama_pretrain", "model=debug_tiny_long",
            "data.batch_size=4", f"data.seq_len={seq}", "trainer.val_every_n_steps=0",
            "logging.progress_bar=false", "logging.every_n_steps=1",
            "checkpoint.export_hf=false", "scheduler.warmup_steps=1",
            f"trainer.max_steps={STEPS}", "trainer.mode=compiled", "trainer.device=tpu"]


def _rel(seq: int) -> float:
    # fp32 rounding over STEPS steps; the longest reduction is attention's, over seq keys.
    return loss_rtol(torch.float32, STEPS, reduction=seq, depth=2)


LAYOUTS = {  # context degree, then the other axes
    "cp2_fsdp4": ["parallel.data=1", "parallel.fsdp=4", "parallel.tensor=1", "parallel.context=2"],
    "cp4_tp2": ["parallel.data=1", "parallel.fsdp=1", "parallel.tensor=2", "parallel.context=4"],
    "cp4_fsdp2": ["parallel.data=1", "parallel.fsdp=2", "parallel.tensor=1", "parallel.context=4"],
    "cp2_fsdp2_tp2": ["parallel.data=1", "parallel.fsdp=2", "parallel.tensor=2",
                      "parallel.context=2"],
}
DEFAULT_LAYOUTS = ("cp2_fsdp4", "cp4_tp2")  # the others run with the 4,096-token set


def _losses(run_dir) -> list[float]:
    metrics = read_metrics(run_dir)
    return [metrics[step]["train/loss"] for step in range(1, STEPS + 1)]


def _one_device_losses(run_dir, seq: int) -> list[float]:
    env = cpu_child_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                        XLA_FLAGS="--xla_force_host_platform_device_count=1")
    done = subprocess.run([sys.executable, "-m", "tpu_train.cli", *_common(seq),
                           "parallel.data=-1", f"run.dir={run_dir}"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = _losses(run_dir)
    assert losses[-1] < losses[0]  # it trained: not copies of one loss
    return losses


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return _one_device_losses(tmp_path_factory.mktemp("one_device") / "run", SEQ)


@pytest.fixture(scope="module")
def one_device_long(tmp_path_factory):
    return _one_device_losses(tmp_path_factory.mktemp("one_device_long") / "run", LONG_SEQ)


def _check_layout(layout: str, seq: int, reference: list[float], run_dir) -> None:
    code, out, err = run_in_process(*_common(seq), *LAYOUTS[layout], f"run.dir={run_dir}")
    assert code == 0, err
    degrees = dict(item.split("=") for item in LAYOUTS[layout])
    assert (f"fsdp={degrees['parallel.fsdp']} tensor={degrees['parallel.tensor']} "
            f"context={degrees['parallel.context']} (8 devices, 1 process)" in out), out
    assert re.search(r"(compiled|loaded) the train step .*: first call", out), out
    assert _losses(run_dir) == pytest.approx(reference, rel=_rel(seq))


@pytest.mark.devices(8)
@pytest.mark.parametrize("layout", DEFAULT_LAYOUTS)
def test_context_parallel_matches_one_device(layout, one_device, tmp_path):
    _check_layout(layout, SEQ, one_device, tmp_path / "run")


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the one-device reference materializes [4, 4, 4096, 4096] scores
@pytest.mark.devices(8)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_matches_one_device_at_4096_tokens(layout, one_device_long, tmp_path):
    _check_layout(layout, LONG_SEQ, one_device_long, tmp_path / "run")


@pytest.mark.devices(8)
def test_each_device_attends_at_its_shards_length(tmp_path):
    """The lowered program's attention: per device, each of its two chunks of S / 8 queries
    against blocks of the S gathered keys (the shard_map body's score tiles), and no scores
    over the whole sequence anywhere."""
    from hydra import compose, initialize_config_dir

    from tpu_train import cli, trainer
    from tpu_train.trainer.config import register_schema

    register_schema()
    overrides = [*_common(SEQ), *LAYOUTS["cp4_tp2"], f"run.dir={tmp_path}"]
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    job = trainer.start(cfg)
    run = trainer.assemble(job)
    step = run.step_fn
    step.place()
    assert float(step(next(iter(run.data.train)))["loss"]) > 0
    (program,) = step.compiled.cache.entries.values()
    text = program.lowered.as_text()
    # Score tiles: [batch, kv heads / tensor, query heads per kv head, queries, keys]; batch 4
    # (no data split), one of the 2 kv heads per tensor shard, a chunk of S / 8 queries.
    block = math.gcd(SEQ, SEQ // 8, KEY_BLOCK)
    tile = f"tensor<4x1x2x{SEQ // 8}x{block}xf32>"
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert any(line.rstrip().endswith(f"-> {tile}") for line in dots), \
        [d for d in dots if "x2x" in d][:6]
    assert not any(re.search(rf"x{SEQ}xf32>$", line.rstrip()) for line in dots)
    gathers = [line for line in text.splitlines() if "all_gather" in line]
    assert gathers, "the keys and values are gathered over the context axis"
    # Outside attention the activations are pinned with their sequence on `context` (the
    # family plan's activation rule): the residual stream [batch, S, dim] among them.
    pinned = [line for line in text.splitlines() if "sharding_constraint" in line
              and '{"context"}' in line]
    assert any(line.rstrip().endswith(f"tensor<4x{SEQ}x64xf32>") for line in pinned), \
        [line for line in text.splitlines() if "sharding_constraint" in line][:6]
