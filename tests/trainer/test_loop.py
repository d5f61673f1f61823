"""Training loop behaviour: exact resume after SIGKILL (and a damaged newest checkpoint), SIGTERM, non-finite loss, TensorBoard."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.trainer.cli_helpers import TINY, TINY_COMPILED, read_metrics, run_in_process, start_subprocess
from tests.trainer.loss_bounds import assert_base_model_losses_close
from tpu_train.trainer.checkpoint import MODEL_FILE, list_checkpoints

STEPS = 6


def _wait_for_step(process, run_dir, step, timeout=240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if step in read_metrics(run_dir):
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _wait_for_checkpoints(process, run_dir, count, timeout=240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(list_checkpoints(run_dir)) >= count:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{count} checkpoints not written in {timeout} s")


# The eager run's child is on the host CPU, which needs no chip (start_subprocess); the
# compiled one's is on the tpu device, and its parent compares with its own run there.
@pytest.mark.parametrize("mode", [
    pytest.param(TINY, id="eager_cpu"),
    pytest.param(TINY_COMPILED, id="compiled_tpu", marks=pytest.mark.device_in_child)])
def test_resume_after_sigkill_is_bitwise_identical(tmp_path, mode):
    """SIGKILL mid-run, then the newest checkpoint damaged as well (half its model file gone):
    the resume falls back to the one before, with a warning, and replays every step exactly."""
    common = [*mode, f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=1",
              "data.shuffle_buffer=16"]
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    code, _, err = run_in_process(*common, f"run.dir={reference_dir}")
    assert code == 0, err

    process = start_subprocess(*common, f"run.dir={killed_dir}")
    try:
        _wait_for_checkpoints(process, killed_dir, 2)
    finally:
        process.kill()
        process.communicate()
    saved = list_checkpoints(killed_dir)
    assert len(saved) >= 2 and saved[-1][0] < STEPS, saved
    model_file = saved[-1][1] / MODEL_FILE
    model_file.write_bytes(model_file.read_bytes()[: model_file.stat().st_size // 2])

    code, out, err = run_in_process(*common, f"run.dir={killed_dir}")
    assert code == 0, err
    assert f"resumed from {saved[-2][1].name}" in out
    assert f"checkpoint {saved[-1][1]} is damaged" in err
    reference, resumed = read_metrics(reference_dir), read_metrics(killed_dir)
    assert sorted(reference) == sorted(resumed) == list(range(1, STEPS + 1))
    for step in reference:
        assert resumed[step]["train/loss"] == reference[step]["train/loss"], step
        assert resumed[step]["train/grad_norm"] == reference[step]["train/grad_norm"], step


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    process = start_subprocess(*TINY, "trainer.max_steps=500", "checkpoint.every_n_steps=1000",
                               f"run.dir={run_dir}")
    _wait_for_step(process, run_dir, 1)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert "stopped by SIGTERM" in out
    saved = [step for step, _ in list_checkpoints(run_dir)]
    assert len(saved) == 1 and 1 <= saved[0] < 500


@pytest.mark.host_cpu_run
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*TINY, "trainer.max_steps=8", "checkpoint.every_n_steps=1",
                                    "scheduler=constant", "optim.lr=1e30", "trainer.max_grad_norm=null",
                                    f"run.dir={run_dir}")
    assert code == 1, (out, err)
    assert "tpu-train: stopped: loss is" in err and "last good checkpoint" in err
    saved = list_checkpoints(run_dir)
    assert saved, "the first (finite) steps must have been checkpointed"
    assert f"{saved[-1][1]}" in err
    assert f"after the change, resume with: tpu-train " in err and f"run.dir={run_dir}" in err
    losses = read_metrics(run_dir)
    assert all(record["train/loss"] == record["train/loss"] for record in losses.values())


@pytest.mark.host_cpu_run
def test_on_nan_skip_continues(tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*TINY, "trainer.max_steps=4", "scheduler=constant",
                                    "optim.lr=1e30", "trainer.max_grad_norm=null",
                                    "trainer.on_nan=skip", f"run.dir={run_dir}")
    assert code == 0, err
    assert "update skipped" in out
    assert [step for step, _ in list_checkpoints(run_dir)] == [4]


@pytest.mark.host_cpu_run
def test_tensorboard_scalars_are_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    code, _, err = run_in_process(*TINY, "trainer.max_steps=2", "trainer.val_every_n_steps=1",
                                  "trainer.val_batches=1", "recipe.eval.exact_match_examples=2",
                                  "recipe.eval.max_new_tokens=4", f"run.dir={run_dir}")
    assert code == 0, err
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
                "train/step_time_s", "val/loss", "val/exact_match"}
    assert expected <= tags, tags
    assert "train/mfu" not in tags  # the CPU is not in the peak table: no guessed MFU
    assert len(events.Scalars("train/loss")) == 2
    # Every validation reads the validation file afresh: a loss before the first step
    # (trainer.val_at_start) and at each of the two steps.
    assert [event.step for event in events.Scalars("val/loss")] == [0, 1, 2]


def test_compiled_run_validates_the_trained_weights(tmp_path):
    """On the CPU client a compiled run validates a CPU copy of the model: the copy must hold
    the weights the step trained (the exported ones), not the initial ones."""
    import torch

    from tests.trainer.cli_helpers import TINY_COMPILED
    from tpu_train.data import PackedLoader, default_corpus_dir, load_tokenizer
    from tpu_train.models import from_pretrained
    from tpu_train.trainer.config import Precision
    from tpu_train.trainer.evaluation import validation_loss

    run_dir = tmp_path / "run"
    code, _, err = run_in_process(*TINY_COMPILED, "trainer.max_steps=2", "trainer.val_every_n_steps=2",
                                  "trainer.val_batches=1", "recipe.eval.exact_match_examples=2",
                                  "recipe.eval.max_new_tokens=4", "checkpoint.export_hf=true",
                                  f"run.dir={run_dir}")
    assert code == 0, err
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "val/loss" in line]
    # Step 0 validates the starting model (trainer.val_at_start); step 2 the trained one.
    assert [record["step"] for record in logged] == [0, 2] and "val/exact_match" in logged[1]
    assert logged[1]["val/loss"] != logged[0]["val/loss"]
    exported = from_pretrained(run_dir / "hf", dtype=torch.float32, device="cpu")
    loader = PackedLoader(default_corpus_dir() / "tasks_heldout.jsonl", load_tokenizer(), 32, 8,
                          num_epochs=1, drop_last=False)
    expected = validation_loss(exported, loader, torch.device("cpu"), 1, Precision.fp32)["loss"]
    # The same weights' forward over one 8-row batch by the run's validation (on a chip, its
    # XLA program) and by PyTorch on the CPU.
    assert_base_model_losses_close([logged[1]["val/loss"]], [expected], rows=8,
                                   what="validation loss", trained=False)


def _system_rows(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if any(key.startswith("system/") for key in row)]


def test_a_run_on_the_host_cpu_asks_no_device_backend_for_its_peak_memory(tmp_path,
                                                                          monkeypatch):
    """trainer.device=cpu holds nothing on a device: asking JAX's backend for a peak would open
    it (on a TPU host, the chip, which another process may hold)."""
    from tpu_train.trainer import loop

    monkeypatch.setattr(loop, "peak_bytes_per_device",
                        lambda: pytest.fail("a run on the host CPU asked a device for its peak"))
    run_dir = tmp_path / "run"
    code, _, err = run_in_process(*TINY, "trainer.max_steps=1", f"run.dir={run_dir}")
    assert code == 0, err
    [row] = _system_rows(run_dir)
    assert row["system/param_bytes_per_device"] > 0 and "system/peak_bytes_per_device" not in row


def test_the_peak_memory_is_read_from_the_chosen_platforms_devices(monkeypatch):
    """The devices of tpu_train's platform (TPU_TRAIN_PLATFORM), not JAX's default backend."""
    from tpu_train.device import runtime
    from tpu_train.trainer.parallelism import peak_bytes_per_device

    class Reporting:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    monkeypatch.setattr(runtime, "devices", lambda: (
        Reporting({"peak_bytes_in_use": 5}), Reporting(None), Reporting({"peak_bytes_in_use": 7})))
    assert peak_bytes_per_device() == 7
    monkeypatch.setattr(runtime, "devices", lambda: (Reporting({}),))
    assert peak_bytes_per_device() is None
