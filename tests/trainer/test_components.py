"""Unit tests of schedules, LoRA, checkpoint atomicity and the MFU table."""

from __future__ import annotations

import pytest
import torch

from tests.tolerances import rtol_for

from tpu_train.trainer.checkpoint import (
    CheckpointManager, latest_checkpoint, read_checkpoint, write_checkpoint,
)
from tpu_train.trainer.lora import LoRALinear, apply_lora, merge_lora
from tpu_train.trainer.metrics import format_log_line, peak_bf16_tflops
from tpu_train.trainer.schedules import WarmupCosine, WarmupStableDecay


def test_warmup_cosine_shape():
    schedule = WarmupCosine(warmup_steps=4, total_steps=20, min_ratio=0.1)
    assert [schedule(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule(4) == pytest.approx(1.0)
    assert schedule(20) == pytest.approx(0.1)
    assert schedule(12) == pytest.approx(0.55)


def test_wsd_is_flat_then_decays_linearly():
    schedule = WarmupStableDecay(warmup_steps=2, total_steps=10, min_ratio=0.0, decay_fraction=0.2)
    assert [schedule(s) for s in range(2, 8)] == [1.0] * 6
    assert schedule(8) == pytest.approx(0.5) and schedule(9) == pytest.approx(0.0)


def test_lora_starts_as_identity_and_merges_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    before = model(x)
    wrapped = apply_lora(model, ["0", "2"], rank=2, alpha=4.0)
    assert wrapped == ["0", "2"] and isinstance(model[0], LoRALinear)
    assert torch.equal(model(x), before)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"0.lora_a", "0.lora_b", "2.lora_a", "2.lora_b"}
    with torch.no_grad():
        model[0].lora_b.normal_()
    adapted = model(x)
    merge_lora(model)
    assert isinstance(model[0], torch.nn.Linear)
    # The merged weight W + s*B@A against the two matmuls: fp32 rounding of a reduction over
    # the layer's inputs (in_features) and the adapter rank.
    tol = rtol_for(torch.float32, reduction=model[0].in_features)
    torch.testing.assert_close(model(x), adapted, rtol=tol, atol=tol)


def test_lora_unknown_target_names_the_alternatives():
    with pytest.raises(ValueError, match="linear layer names are: 0"):
        apply_lora(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["q_proj"], rank=1, alpha=1.0)


def test_interrupted_save_is_never_resumed(tmp_path, monkeypatch):
    directory = tmp_path / "checkpoints"
    state = {"w": torch.ones(2)}
    write_checkpoint(directory, 1, state, {"step": 1})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        write_checkpoint(directory, 2, state, {"step": 2})
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    assert sorted(p.name for p in directory.iterdir()) == ["step_00000001"]


def test_keep_last_and_async_save(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=True)
    for step in (1, 2, 3):
        manager.save(step, {"w": torch.full((2,), float(step))}, {"step": step})
    manager.wait()
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    assert len(list((tmp_path / "checkpoints").iterdir())) == 2
    model_state, training_state, meta = read_checkpoint(latest_checkpoint(tmp_path))
    assert meta["step"] == 3 and training_state == {"step": 3}
    assert torch.equal(model_state["w"], torch.full((2,), 3.0))


def test_an_async_save_keeps_owned_tensors_and_snapshots_the_rest(tmp_path, monkeypatch):
    import threading

    release, write = threading.Event(), CheckpointManager._write

    def delayed_write(self, step, model_state, training_state):
        release.wait(5)
        write(self, step, model_state, training_state)

    monkeypatch.setattr(CheckpointManager, "_write", delayed_write)
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=True)
    live, copied = torch.zeros(3), torch.zeros(3)
    manager.save(1, {"live": live, "copied": copied}, {"step": 1}, owned=frozenset({id(copied)}))
    live.fill_(7.0)  # the trainer goes on: the snapshot taken at save() is what gets written
    copied.fill_(5.0)  # an owned tensor is not copied again: nothing else may write it
    release.set()
    manager.wait()
    model_state, _, _ = read_checkpoint(latest_checkpoint(tmp_path))
    assert torch.equal(model_state["live"], torch.zeros(3))
    assert torch.equal(model_state["copied"], torch.full((3,), 5.0))


def test_a_failed_run_waits_for_the_save_in_flight_and_logs_its_error(tmp_path, monkeypatch):
    import threading
    import types

    from tpu_train.trainer.loop import _finish_pending_save

    release, lines = threading.Event(), []
    write = CheckpointManager._write

    def slow_write(self, step, model_state, training_state):
        release.wait(5)
        if step == 2:
            raise OSError("disk full")
        write(self, step, model_state, training_state)

    monkeypatch.setattr(CheckpointManager, "_write", slow_write)
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=True)
    run = types.SimpleNamespace(checkpointer=manager,
                                logger=types.SimpleNamespace(line=lines.append))
    manager.save(1, {"w": torch.ones(2)}, {"step": 1})
    assert latest_checkpoint(tmp_path) is None  # still being written
    release.set()
    _finish_pending_save(run)
    assert latest_checkpoint(tmp_path).name == "step_00000001" and lines == []
    manager.save(2, {"w": torch.ones(2)}, {"step": 2})
    _finish_pending_save(run)
    assert lines == ["the checkpoint being written when the run failed was not saved: "
                     "saving a checkpoint failed: disk full"]
    assert latest_checkpoint(tmp_path).name == "step_00000001"


def test_peak_table_is_explicit():
    assert peak_bf16_tflops("TPU v5 lite") == 197.0
    assert peak_bf16_tflops("TPU v4") == 275.0
    assert peak_bf16_tflops("NVIDIA H200") == 989.0
    assert peak_bf16_tflops("cpu") is None and peak_bf16_tflops(None) is None
    assert format_log_line(1, 2, {"loss": 1.0}).endswith("mfu unknown")
