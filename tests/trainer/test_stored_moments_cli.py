"""``optim.state_dtype=bf16`` from the command line: AdamW's moments are bfloat16 in the step
(compiled and eager), in the printed memory and in the checkpoint, and a resume from that
checkpoint replays the steps exactly."""

from __future__ import annotations

import shutil

import pytest
import torch
from omegaconf import OmegaConf

from tests.trainer.cli_helpers import TINY, TINY_COMPILED, one_thread, read_metrics, run_in_process
from tests.compile.test_stored_moments import bf16_moments_loss_bound
from tpu_train.device import runtime
from tpu_train.trainer.config import OptimConfig
from tpu_train.trainer.optim import build_optimizer
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


def eager_losses(run_dir, state_dtype: str) -> tuple[dict, str]:
    code, out, err = run_in_process(*BF16, *TINY, "trainer.max_steps=3",
                                    f"optim.state_dtype={state_dtype}", f"run.dir={run_dir}")
    assert code == 0, err
    return read_metrics(run_dir), out


@pytest.mark.usefixtures("one_thread")
def test_eager_runs_store_the_moments_in_the_chosen_dtype(tmp_path):
    torch_adamw, _ = eager_losses(tmp_path / "param", "param")
    fp32, _ = eager_losses(tmp_path / "fp32", "fp32")
    bf16, out = eager_losses(tmp_path / "bf16", "bf16")
    assert "Adam moments in bf16" in out
    assert saved_moment_dtypes(tmp_path / "bf16", 2) == {torch.bfloat16}
    assert saved_moment_dtypes(tmp_path / "fp32", 2) == {torch.float32}
    # fp32 moments over fp32 weights: torch's AdamW step, with every optim.* setting reaching it.
    assert [r["train/loss"] for r in fp32.values()] == \
        [r["train/loss"] for r in torch_adamw.values()]
    # bf16 moments: a different trajectory, within the bound derived from bf16's rounding.
    assert bf16[3]["train/loss"] != torch_adamw[3]["train/loss"]
    cfg = OmegaConf.load(tmp_path / "bf16" / "run_config.yaml").optim
    n_params = 13.01 * 2 ** 20 / 4  # debug_tiny: 13.01 MiB of fp32 parameters
    bounds = bf16_moments_loss_bound([torch_adamw[s]["train/grad_norm"] for s in (1, 2, 3)],
                                     round(n_params), cfg.lr, (cfg.beta1, cfg.beta2))
    for step, bound in zip((1, 2, 3), bounds):
        assert abs(bf16[step]["train/loss"] - torch_adamw[step]["train/loss"]) <= bound, step


def test_state_dtype_without_moments_is_a_one_line_error(tmp_path):
    code, out, err = run_in_process("recipe=llama_pretrain", *TINY, "optim.name=sgd",
                                    "optim.state_dtype=bf16", f"run.dir={tmp_path}")
    assert code != 0
    assert ("optim.state_dtype=bf16 sets the dtype of Adam/AdamW's moments; optim.name=sgd has "
            "none it stores: use optim.name=adamw (or adam), or optim.state_dtype=param") in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_every_optim_setting_reaches_the_stored_moments_variant(name):
    cfg = OptimConfig(name=name, lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.2,
                      state_dtype="bf16")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    variant = build_optimizer(model, cfg)
    plain = build_optimizer(model, OptimConfig(**{**vars(cfg), "state_dtype": "param"}))
    assert variant.state_dtype == torch.bfloat16
    assert isinstance(variant, type(plain))
    for mine, torchs in zip(variant.param_groups, plain.param_groups):
        assert {k: v for k, v in mine.items() if k != "params"} == \
            {k: v for k, v in torchs.items() if k != "params"}
