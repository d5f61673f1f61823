"""``data.prefetch``: training batches built ahead on a thread change nothing a run computes,
saves or reports: resumes are exact, data errors read as before, no thread outlives the run."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from tests.trainer.cli_helpers import TINY, TINY_COMPILED, read_metrics, run_in_process
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


def _worker_processes() -> list[str]:
    """Command lines of this process's live children that serve batches."""
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    found = []
    for pid in children.read_text().split() if children.exists() else []:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # ended meanwhile
        if b"tpu_train.data.worker" in command:
            found.append(command.decode(errors="replace"))
    return found


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
    assert not _prefetch_threads() and not _worker_processes()
    code, out, err = run_in_process(*COMMON, "data.prefetch=3", f"trainer.max_steps={STEPS}",
                                    f"run.dir={run_dir}")
    assert code == 0, err
    assert "resumed from step_00000003" in out
    assert _losses(run_dir) == reference
    assert not _prefetch_threads() and not _worker_processes()


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
    assert not _prefetch_threads() and not _worker_processes()
    monkeypatch.setattr(loop_module._Loop, "_after_step", after_step)
    code, out, err = run_in_process(*COMMON, "data.prefetch=2", f"trainer.max_steps={STEPS}",
                                    f"run.dir={run_dir}")
    assert code == 0, err
    assert "resumed from step_00000002" in out
    assert _losses(run_dir) == reference


def test_a_data_error_while_training_is_the_same_one_line_error(tmp_path):
    """A bad record deep in the file (line 257: past the first read-ahead chunk, which the
    start-up probe reads) fails the 3rd or 4th batch: built in the worker or between steps,
    the run stops after the same steps and the CLI says the same one line, exit 2."""
    data = tmp_path / "train.jsonl"
    # 3-token samples: 256 of them fill 3 batches of 8 rows of 32 tokens.
    data.write_text("".join('{"text": "a"}\n' for _ in range(256)) + "{not json\n")
    outcomes = []
    for prefetch in (0, 2):
        run_dir = tmp_path / f"run{prefetch}"
        # data.holdout=0: a validation probe of a held-out split would read to line 257 first.
        code, _, err = run_in_process(*COMMON, "data=jsonl", f"data.path={data}", "data.holdout=0",
                                      "data.batch_size=8", f"data.prefetch={prefetch}",
                                      f"trainer.max_steps={STEPS}", f"run.dir={run_dir}")
        outcomes.append((code, err.strip(), sorted(read_metrics(run_dir))))
        assert not _prefetch_threads() and not _worker_processes()
    assert outcomes[0] == outcomes[1]
    code, err, steps = outcomes[0]
    assert code == 2 and err.startswith(f"tpu-train: error: {data}:257: ") and "\n" not in err
    assert steps in ([1, 2], [1, 2, 3])


def test_the_compiled_step_reads_each_batch_put_during_the_step_before(tmp_path, monkeypatch):
    """The loop places batch k+1 as the compiled step reads it once step k is dispatched (on
    a TPU a program waits for its host arguments' transfers before it starts): over this
    session's 8-device mesh the layout's global arrays, on one chip the device's tensors
    (``CompiledTrainStep.put_batch``, tests/compile/test_step_inputs.py). The first batch is
    placed before its step too; one program; the losses of a run that places each batch at
    its call."""
    from tpu_train.compile import CompiledTrainStep
    from tpu_train.device.tensor import TpuTensor
    from tpu_train.trainer.step import BatchesAhead

    settings = [*TINY_COMPILED, "trainer.max_steps=3"]
    events = []
    put_batch, call = CompiledTrainStep.put_batch, CompiledTrainStep.__call__

    def recording_put(self, batch):
        events.append("put")
        return put_batch(self, batch)

    def recording_call(self, batch):
        events.append("call on device" if all(isinstance(t, TpuTensor) for t in batch.values())
                      else "call on host")
        return call(self, batch)

    def recording_float(value):  # the loop's reads of a step's results
        if events[-1] != "read":
            events.append("read")
        return float(value)

    monkeypatch.setattr(CompiledTrainStep, "put_batch", recording_put)
    monkeypatch.setattr(CompiledTrainStep, "__call__", recording_call)
    monkeypatch.setattr(loop_module, "float", recording_float, raising=False)
    code, out, err = run_in_process(*settings, f"run.dir={tmp_path / 'ahead'}")
    assert code == 0, err
    # compile_ahead's, the first step's, then each while the step before it runs
    assert events == ["put", "put", "call on device", "put", "read", "call on device", "put",
                      "read", "call on device", "read"]
    assert out.count("the train step") == 2, out  # the notice, and its one compile or load

    monkeypatch.setattr(BatchesAhead, "put_next", lambda self: None)
    code, _, err = run_in_process(*settings, f"run.dir={tmp_path / 'at_call'}")
    assert code == 0, err
    assert _losses(tmp_path / "ahead") == _losses(tmp_path / "at_call")
