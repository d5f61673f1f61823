"""``data.prefetch``: training batches built ahead on a thread change nothing a run computes,
saves or reports: resumes are exact, data errors read as before, no thread outlives the run."""

from __future__ import annotations

import signal
import threading

import pytest

from tests.trainer.cli_helpers import TINY, read_metrics, run_in_process
from tpu_train.data.errors import DataError
from tpu_train.data.packing import PackedLoader
from tpu_train.trainer import loop as loop_module

# A constant schedule: a run continued to a later max_steps then trains exactly as one that
# was given that max_steps from the start.
COMMON = [*TINY, "scheduler=constant", "data.shuffle_buffer=16", "checkpoint.keep_last=10"]
STEPS = 6


def _losses(run_dir) -> dict[int, tuple[float, float]]:
    return {step: (row["train/loss"], row["train/grad_norm"])
            for step, row in read_metrics(run_dir).items()}


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "batch-prefetch" and t.is_alive()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses of an uninterrupted run that builds every batch between steps."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    code, _, err = run_in_process(*COMMON, "data.prefetch=0", f"trainer.max_steps={STEPS}",
                                  f"run.dir={run_dir}")
    assert code == 0, err
    return _losses(run_dir)


def test_prefetched_run_and_its_resume_match_an_unprefetched_run(reference, tmp_path):
    """The first run ends at step 3 with the thread 3 batches ahead (depth 3): the checkpoint
    holds the position after the 3rd batch, and the continued run replays steps 4-6 exactly."""
    run_dir = tmp_path / "run"
    code, _, err = run_in_process(*COMMON, "data.prefetch=3", "trainer.max_steps=3",
                                  f"run.dir={run_dir}")
    assert code == 0, err
    assert not _prefetch_threads()
    code, out, err = run_in_process(*COMMON, "data.prefetch=3", f"trainer.max_steps={STEPS}",
                                    f"run.dir={run_dir}")
    assert code == 0, err
    assert "resumed from step_00000003" in out
    assert _losses(run_dir) == reference
    assert not _prefetch_threads()


def test_a_stopped_run_saves_the_position_of_the_last_consumed_batch(reference, tmp_path,
                                                                     monkeypatch):
    """SIGTERM after step 2 (the run's own handler turns it into a stop between steps): the
    stop's checkpoint resumes at batch 3, not at the batches the thread had built since."""
    after_step = loop_module._Loop._after_step

    def terminate_after_step_2(self, *args):
        after_step(self, *args)
        if self.step == 2:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(loop_module._Loop, "_after_step", terminate_after_step_2)
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*COMMON, "data.prefetch=2", f"trainer.max_steps={STEPS}",
                                    "checkpoint.every_n_steps=100", f"run.dir={run_dir}")
    assert code == 0, err
    assert "stopped by SIGTERM at step 2" in out
    assert not _prefetch_threads()
    monkeypatch.setattr(loop_module._Loop, "_after_step", after_step)
    code, out, err = run_in_process(*COMMON, "data.prefetch=2", f"trainer.max_steps={STEPS}",
                                    f"run.dir={run_dir}")
    assert code == 0, err
    assert "resumed from step_00000002" in out
    assert _losses(run_dir) == reference


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_data_error_while_training_is_the_same_one_line_error(prefetch, tmp_path,
                                                               monkeypatch):
    """The training loader's 4th batch fails (as a bad record deep in a file would): built
    on the thread or between steps, the CLI says the same one line and exits 2 at step 3."""
    calls: dict[int, int] = {}
    original = PackedLoader.__next__

    def fail_on_4th(self):
        calls[id(self)] = calls.get(id(self), 0) + 1
        if calls[id(self)] == 4:
            raise DataError("not valid JSON (Expecting value); fix or remove the line",
                            "train.jsonl", 300)
        return original(self)

    monkeypatch.setattr(PackedLoader, "__next__", fail_on_4th)
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*COMMON, f"data.prefetch={prefetch}",
                                    f"trainer.max_steps={STEPS}", f"run.dir={run_dir}")
    assert code == 2, err
    assert err.strip() == ("tpu-train: error: train.jsonl:300: not valid JSON (Expecting "
                           "value); fix or remove the line")
    assert sorted(read_metrics(run_dir)) == [1, 2, 3]
    assert not _prefetch_threads()
