"""Nothing lost, nothing silent: checkpoint integrity, non-finite updates, metrics on resume,
safe loading of sharded checkpoint metadata."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.cli_helpers import TINY, TINY_COMPILED, read_metrics, run_in_process
from tpu_train.trainer import builders, step as step_mod
from tpu_train.trainer.checkpoint import (META_FILE, MODEL_FILE, TRAINING_STATE_FILE,
                                          list_checkpoints, non_finite_tensors,
                                          verify_checkpoint)

CONSTANT = ["scheduler=constant", "checkpoint.keep_last=10"]


def _strict(name):
    raise ValueError(f"non-strict JSON constant {name}")


def _training(run_dir):
    """Per step, the values training determines (not the timings)."""
    keys = ("train/loss", "train/grad_norm", "train/lr", "train/skipped_updates")
    return {step: {k: row.get(k) for k in keys} for step, row in read_metrics(run_dir).items()}


def _rows(run_dir):
    return [json.loads(line, parse_constant=_strict)
            for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- integrity

@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """An uninterrupted 4-step eager run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    code, _, err = run_in_process(*TINY, *CONSTANT, "trainer.max_steps=4",
                                  "checkpoint.every_n_steps=2", f"run.dir={run_dir}")
    assert code == 0, err
    return run_dir


def _damage(path, action):
    if action == "delete":
        path.unlink()
    elif action == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:  # flip bytes in the middle
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        for i in range(middle, min(middle + 8, len(data))):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.host_cpu_run
def test_meta_records_a_checksum_per_file(base_run):
    saved = list_checkpoints(base_run)
    assert [step for step, _ in saved] == [2, 4]
    meta = json.loads((saved[-1][1] / META_FILE).read_text())
    assert set(meta["files"]) == {MODEL_FILE, TRAINING_STATE_FILE}
    assert all(len(digest) == 64 for digest in meta["files"].values())
    assert verify_checkpoint(saved[-1][1]) is None


@pytest.mark.host_cpu_run
@pytest.mark.parametrize("action", ["truncate", "flip", "delete"])
@pytest.mark.parametrize("name", [MODEL_FILE, TRAINING_STATE_FILE, META_FILE])
def test_damaged_latest_checkpoint_falls_back_with_a_warning(base_run, tmp_path, name, action):
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    damaged = run_dir / "checkpoints" / "step_00000004"
    _damage(damaged / name, action)
    assert verify_checkpoint(damaged) is not None
    code, out, err = run_in_process(*TINY, *CONSTANT, "trainer.max_steps=4",
                                    "checkpoint.every_n_steps=2", f"run.dir={run_dir}")
    assert code == 0, err
    warning = [line for line in err.splitlines() if "warning: checkpoint" in line]
    assert len(warning) == 1, err
    assert "step_00000004" in warning[0] and "step_00000002" in warning[0], warning
    assert "resumed from step_00000002" in out
    assert "step_00000004" in (run_dir / "train.log").read_text()
    # The replayed steps have exactly the uninterrupted run's losses, logged once each.
    assert _training(run_dir) == _training(base_run)
    assert [row["step"] for row in _rows(run_dir) if "train/loss" in row] == [1, 2, 3, 4]
    assert verify_checkpoint(run_dir / "checkpoints" / "step_00000004") is None


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """Two checkpoints in the sharded layout (what several processes write), from one process."""
    import torch.distributed.checkpoint as dcp

    from tpu_train.trainer.checkpoint import write_sharded_checkpoint
    from tpu_train.trainer.world import World

    run_dir = tmp_path_factory.mktemp("sharded") / "run"
    for step in (1, 2):
        state = {"w": torch.full((64,), float(step)), "b": torch.arange(8.0) * step}
        write_sharded_checkpoint(run_dir / "checkpoints", step,
                                 lambda path, state=state: dcp.save(state, checkpoint_id=path,
                                                                    no_dist=True),
                                 {"step": step}, World(0, 1))
    return run_dir


def _sharded_files(checkpoint):
    return sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())


@pytest.mark.parametrize("action", ["truncate", "flip", "delete"])
@pytest.mark.parametrize("index", range(4))
def test_damaged_sharded_checkpoint_is_detected_and_passed_over(sharded_run, tmp_path, index,
                                                                action):
    """Each file of a sharded checkpoint (shards, .metadata, training state, meta.json) is
    covered: damaged, the checkpoint fails verification and the older one is chosen."""
    from tpu_train.trainer.checkpoint import latest_intact_checkpoint

    run_dir = tmp_path / "run"
    shutil.copytree(sharded_run, run_dir)
    newest = run_dir / "checkpoints" / "step_00000002"
    files = _sharded_files(newest)
    assert len(files) == 4, files  # meta.json, training_state.pt, sharded/.metadata, one shard
    _damage(newest / files[index], action)
    chosen, damaged = latest_intact_checkpoint(run_dir)
    assert chosen == run_dir / "checkpoints" / "step_00000001"
    assert [path for path, _ in damaged] == [newest]


@pytest.mark.host_cpu_run
def test_load_step_naming_a_damaged_checkpoint_is_a_one_line_error(base_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    _damage(run_dir / "checkpoints" / "step_00000002" / MODEL_FILE, "flip")
    code, out, err = run_in_process(*TINY, *CONSTANT, "trainer.max_steps=4",
                                    "checkpoint.load_step=2", f"run.dir={run_dir}")
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "checkpoint.load_step=2" in lines[0] and "damaged" in lines[0]
    assert MODEL_FILE in lines[0]


@pytest.mark.host_cpu_run
def test_every_checkpoint_damaged_is_a_clear_error(base_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    for step in (2, 4):
        _damage(run_dir / "checkpoints" / f"step_{step:08d}" / TRAINING_STATE_FILE, "truncate")
    code, _, err = run_in_process(*TINY, *CONSTANT, "trainer.max_steps=4", f"run.dir={run_dir}")
    assert code == 2, err
    assert "every checkpoint is damaged" in err


@pytest.mark.host_cpu_run
def test_checkpoint_without_checksums_still_loads(base_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    meta_path = run_dir / "checkpoints" / "step_00000002" / META_FILE
    meta = json.loads(meta_path.read_text())
    del meta["files"]  # as written before the checksums existed
    meta_path.write_text(json.dumps(meta))
    code, out, err = run_in_process(*TINY, *CONSTANT, "trainer.max_steps=4",
                                    "checkpoint.every_n_steps=2", f"run.dir={run_dir}")
    assert code == 0, err
    assert "warning" not in err and "resumed from step_00000002" in out
    assert _training(run_dir) == _training(base_run)


# --------------------------------------------------------------------------- non-finite

class _Poisoned:
    """The training loader with a ``poison`` flag per row: 1 in the batches of ``steps``
    (1-based), where the loss below makes every gradient NaN while the loss stays finite."""

    def __init__(self, inner, steps):
        self.inner, self.steps = inner, set(steps)

    def __iter__(self):
        for index, batch in enumerate(self.inner):
            rows = batch["tokens"].shape[0]
            yield {**batch, "poison": torch.full((rows,), int(index + 1 in self.steps),
                                                 dtype=torch.int64)}

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def poison(monkeypatch):
    """``poison(steps)``: those steps get a NaN gradient norm with a finite loss, in the eager
    and in the compiled step. The added term is ``0 * sqrt(w - w + clean)``: zero in the
    forward (so the loss is bit for bit the real one), and in the backward ``0 / 0 = nan``
    exactly when ``clean`` is 0."""
    original_loss = step_mod.causal_lm_loss_sum
    original_loader = builders.build_train_loader

    def loss_sum(model, batch):
        if "poison" not in batch:
            return original_loss(model, batch)
        loss = original_loss(model, {k: v for k, v in batch.items() if k != "poison"})
        weight = next(model.parameters())
        clean = 1.0 - batch["poison"].max().to(weight.dtype)
        return loss + (0.0 * torch.sqrt(weight - weight + clean)).sum().to(loss.dtype)

    def arm(steps):
        monkeypatch.setattr(step_mod, "causal_lm_loss_sum", loss_sum)
        monkeypatch.setattr(builders, "build_train_loader",
                            lambda *a, **k: _Poisoned(original_loader(*a, **k), steps))

    return arm


def _assert_finite_checkpoints(run_dir):
    for _, path in list_checkpoints(run_dir):
        assert verify_checkpoint(path) is None
        assert not non_finite_tensors(load_file(str(path / MODEL_FILE))), path
        state = torch.load(path / TRAINING_STATE_FILE, weights_only=True)
        assert not non_finite_tensors(state["optimizer"]), path


MODES = pytest.mark.parametrize("mode", [
    pytest.param(TINY, id="eager", marks=pytest.mark.host_cpu_run),
    pytest.param(TINY_COMPILED, id="compiled")])


@MODES
def test_nan_grad_norm_with_finite_loss_is_skipped_and_counted(tmp_path, poison, mode):
    poison([3])
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*mode, *CONSTANT, "trainer.max_steps=4",
                                    "checkpoint.every_n_steps=1", "trainer.on_nan=skip",
                                    f"run.dir={run_dir}")
    assert code == 0, err
    skipped = [line for line in out.splitlines() if "update skipped" in line]
    assert len(skipped) == 1 and skipped[0].startswith("step 3:"), out
    metrics = read_metrics(run_dir)
    assert [metrics[s]["train/skipped_updates"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert metrics[3]["train/loss"] == metrics[3]["train/loss"]  # finite loss
    assert metrics[3]["train/grad_norm"] != metrics[3]["train/grad_norm"]  # nan
    rows = _rows(run_dir)  # strict JSON: null plus a flag
    row = [r for r in rows if r["step"] == 3 and "train/loss" in r][0]
    assert row["train/grad_norm"] is None and row["train/grad_norm_nonfinite"] == "nan"
    # The update of step 3 was not applied: its checkpoint holds step 2's parameters, and
    # the optimizer's step count did not advance.
    saved = dict(list_checkpoints(run_dir))
    assert sorted(saved) == [1, 2, 3, 4]
    before, after = load_file(str(saved[2] / MODEL_FILE)), load_file(str(saved[3] / MODEL_FILE))
    assert all(torch.equal(before[k], after[k]) for k in before)
    steps = [torch.load(saved[s] / TRAINING_STATE_FILE, weights_only=True)["optimizer"]
             ["state"][0]["step"] for s in (2, 3, 4)]
    assert [float(s) for s in steps] == [2.0, 2.0, 3.0]
    after4 = load_file(str(saved[4] / MODEL_FILE))
    assert not all(torch.equal(after[k], after4[k]) for k in after)  # training went on
    _assert_finite_checkpoints(run_dir)


@MODES
def test_nan_grad_norm_with_on_nan_stop_stops_before_the_update(tmp_path, poison, mode):
    poison([3])
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*mode, *CONSTANT, "trainer.max_steps=4",
                                    "checkpoint.every_n_steps=1", f"run.dir={run_dir}")
    assert code == 1, (out, err)
    assert "gradient norm is nan" in err and "the update was not applied" in err
    assert "step_00000002 (verified)" in err
    assert [step for step, _ in list_checkpoints(run_dir)] == [1, 2]
    _assert_finite_checkpoints(run_dir)


def test_non_finite_tensors_names_them():
    big = torch.finfo(torch.float32).max
    state = {"a": torch.ones(2), "b": {"c": torch.tensor([1.0, float("inf")])},
             "d": [torch.tensor([float("nan")])], "e": torch.tensor([1]), "f": 1.0,
             # finite values whose sum overflows: not named
             "g": torch.tensor([big, big]), "h": torch.tensor([1e308, 1e308], dtype=torch.float64),
             "i": torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16),
             "j": torch.tensor([float("inf"), float("-inf")])}
    assert non_finite_tensors(state) == ["b.c", "d[0]", "i", "j"]


# --------------------------------------------------------------------------- metrics

@pytest.mark.host_cpu_run
def test_resume_truncates_metrics_after_the_resumed_step(base_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")  # as if killed after step 4's row
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 5, "train/lo')  # a row cut by the crash
    code, _, err = run_in_process(*TINY, *CONSTANT, "trainer.max_steps=4",
                                  "checkpoint.every_n_steps=2", f"run.dir={run_dir}")
    assert code == 0, err
    steps = [row["step"] for row in _rows(run_dir) if "train/loss" in row]
    assert steps == [1, 2, 3, 4]
    assert _training(run_dir) == _training(base_run)


# --------------------------------------------------------------------------- safe loading

class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_restricted_unpickler_refuses_crafted_metadata(tmp_path):
    from tpu_train.parallel.sharded_checkpoint import UnsafeCheckpointError, read_metadata_safely

    marker = tmp_path / "pwned"
    checkpoint = tmp_path / "sharded"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load (posix|os)\.system"):
        read_metadata_safely(checkpoint)
    assert not marker.exists()
    (checkpoint / ".metadata").write_bytes(b"garbage")
    with pytest.raises(UnsafeCheckpointError, match="not a readable checkpoint metadata"):
        read_metadata_safely(checkpoint)


def test_restricted_unpickler_reads_real_dcp_metadata(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata

    from tpu_train.parallel.sharded_checkpoint import read_metadata_safely

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16),
                  "c": torch.tensor([1])}, storage_writer=dcp.FileSystemWriter(tmp_path),
                 no_dist=True)
    metadata = read_metadata_safely(tmp_path)
    assert isinstance(metadata, Metadata) and set(metadata.state_dict_metadata) == {"a", "b", "c"}
