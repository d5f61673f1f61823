"""Validation on the model's own tpu device (one device, as on a one-chip TPU host) computes
the loss as one compiled program per batch shape; the CPU client's runs validate a host copy
instead. A child process with one device takes the device path (the CPU client stands in for
the chip) and must report what the host path reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.trainer.loss_bounds import assert_base_model_losses_close

CHILD = """
import json, sys
from tpu_train.trainer import loop
compiled = []
original = loop.compiled_validation_loss
def counted(evaluator, loader, max_batches):
    result = original(evaluator, loader, max_batches)
    compiled.append(len(evaluator.compilations))
    return result
if sys.argv[1] == "device":
    loop.runs_on_host_cpu = lambda device: False  # as on a TPU host
    loop.compiled_validation_loss = counted
from tpu_train import cli
sys.argv = ["tpu-train", *sys.argv[2:]]
try:
    cli.main()
except SystemExit as exit:
    assert not exit.code, exit.code
print("COMPILED " + json.dumps(compiled))
"""

SETTINGS = ["trainer.max_steps=1", "trainer.val_every_n_steps=1", "trainer.val_batches=2",
            "data.batch_size=2", "data.seq_len=32", "recipe.eval.exact_match_examples=2",
            "recipe.eval.max_new_tokens=4", "logging.progress_bar=false",
            "checkpoint.export_hf=false"]


def _run(path: str, run_dir) -> tuple[list[float], list[int]]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", CHILD, path, *SETTINGS, f"run.dir={run_dir}"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.split("COMPILED ")[-1])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val/loss"] for r in records if "val/loss" in r], compiled


@pytest.mark.device_in_child
def test_validation_on_the_device_is_one_program_and_matches_the_host_copy(tmp_path):
    on_host, none = _run("host", tmp_path / "host")
    on_device, compiled = _run("device", tmp_path / "device")
    assert none == []
    # Before step 1 and after it, both by the one program compiled for the first pass.
    assert len(on_host) == len(on_device) == 2 and compiled == [1, 1]
    # Two implementations of the base model's forward over 2 batches of 2 rows, of the same
    # parameters (the training step is the same program in both runs).
    assert_base_model_losses_close(on_device, on_host, rows=2 * 2, what="validation loss",
                                   trained=False)


class _Batches(list):
    """A validation loader's batches, and its rows per batch."""

    batch_size = 4


def test_a_short_last_batch_runs_the_full_batches_program():
    """The pass pads its short last batch with ignored rows: one program for the pass, and the
    loss of the unpadded rows (against PyTorch on the CPU, the rows as they are)."""
    import copy

    import torch

    from tests.compile.helpers import lm_functions
    from tests.tolerances import loss_rtol
    from tpu_train.models import Llama, LlamaConfig
    from tpu_train.trainer.config import Precision
    from tpu_train.trainer.evaluation import (compiled_loss, compiled_validation_loss,
                                              validation_loss)

    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                      ffn_hidden_dim=64, max_seq_len=16)
    cpu = Llama(cfg)
    cpu.init_weights(seed=0, device="cpu")
    model = copy.deepcopy(cpu).to("tpu")
    g = torch.Generator().manual_seed(0)
    batches = _Batches()
    for rows in (4, 4, 3):
        tokens = torch.randint(0, 64, (rows, 16), generator=g)
        labels = tokens.clone()
        labels[:, :3] = -100
        batches.append({"tokens": tokens, "labels": labels})
    evaluator = compiled_loss(model, Precision.fp32)
    got = compiled_validation_loss(evaluator, batches, max_batches=3)
    want = validation_loss(cpu, batches, torch.device("cpu"), 3, Precision.fp32)
    assert len(evaluator.compilations) == 1
    rtol = loss_rtol(torch.float32, 1, 11 * 13, depth=2, functions=lm_functions(2))
    assert abs(got["loss"] - want["loss"]) <= rtol * want["loss"], (got, want)
    assert model.training and cpu.training  # both passes put the model back in train mode
