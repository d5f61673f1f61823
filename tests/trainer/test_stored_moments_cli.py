"""``optim.state_dtype=bf16`` from the command line: AdamW's moments are bfloat16 in the step
(compiled and eager), in the printed memory and in the checkpoint, and a resume from that
checkpoint replays the steps exactly."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.trainer.cli_helpers import TINY, TINY_COMPILED, one_thread, read_metrics, run_in_process
from tpu_train.device import runtime
from tpu_train.trainer.checkpoint import TRAINING_STATE_FILE, list_checkpoints

__all__ = ["one_thread"]  # a fixture, used by name

BF16 = ["recipe=llama_pretrain", "optim.state_dtype=bf16", "checkpoint.every_n_steps=2",
        "checkpoint.async_save=false"]
MOMENTS = ("exp_avg", "exp_avg_sq")


def saved_moment_dtypes(run_dir, step: int) -> set[torch.dtype]:
    checkpoint = dict(list_checkpoints(run_dir))[step]
    state = torch.load(checkpoint / TRAINING_STATE_FILE, weights_only=True)["optimizer"]["state"]
    assert state, "the checkpoint holds no optimizer state"
    return {values[key].dtype for values in state.values() for key in MOMENTS}


@pytest.mark.usefixtures("one_thread")
def test_compiled_run_keeps_bf16_moments_and_resumes_exactly(tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*BF16, *TINY_COMPILED, "trainer.max_steps=4",
                                    f"run.dir={run_dir}")
    assert code == 0, err
    assert "weights stored in fp32, Adam moments in bf16 (updated in fp32)" in out
    if runtime.device_count() > 1:
        # debug_tiny: 13.01 MiB of fp32 parameters; AdamW's two moments at 2 bytes a value
        # add 13.01 MiB where fp32 moments add 26.02 (39.03 MiB: tests/compile/
        # test_optimizer_cli.py). On one device the state is created by the first step.
        assert "26.02 MiB of parameters + optimizer state on the busiest device" in out
    assert saved_moment_dtypes(run_dir, 2) == saved_moment_dtypes(run_dir, 4) == {torch.bfloat16}

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed_dir)
    code, out, err = run_in_process(*BF16, *TINY_COMPILED, "trainer.max_steps=4",
                                    "checkpoint.load_step=2", f"run.dir={resumed_dir}")
    assert code == 0, err
    assert "resumed from step_00000002" in out
    reference, resumed = read_metrics(run_dir), read_metrics(resumed_dir)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step]["train/loss"] == reference[step]["train/loss"], step
        assert resumed[step]["train/grad_norm"] == reference[step]["train/grad_norm"], step
    assert saved_moment_dtypes(resumed_dir, 4) == {torch.bfloat16}


@pytest.mark.usefixtures("one_thread")
def test_eager_run_trains_with_bf16_moments(tmp_path):
    code, out, err = run_in_process(*BF16, *TINY, "trainer.max_steps=2", f"run.dir={tmp_path}")
    assert code == 0, err
    assert "Adam moments in bf16" in out
    assert saved_moment_dtypes(tmp_path, 2) == {torch.bfloat16}
    losses = [r["train/loss"] for _, r in sorted(read_metrics(tmp_path).items())]
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses)))


def test_state_dtype_without_moments_is_a_one_line_error(tmp_path):
    code, out, err = run_in_process("recipe=llama_pretrain", *TINY, "optim.name=sgd",
                                    "optim.state_dtype=bf16", f"run.dir={tmp_path}")
    assert code != 0
    assert ("optim.state_dtype=bf16 sets the dtype of Adam/AdamW's moments; optim.name=sgd has "
            "none it stores: use optim.name=adamw (or adam), or optim.state_dtype=param") in err
    assert not list(tmp_path.iterdir())
