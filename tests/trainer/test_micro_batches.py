"""trainer.micro_batch_size: a shard's rows run a few at a time, the step's result unchanged."""

from __future__ import annotations

import pytest
import torch

from tests.tolerances import loss_rtol
from tests.trainer.cli_helpers import TINY, TINY_COMPILED, read_metrics, run_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3


def _losses(tmp_path, name: str, *overrides: str) -> tuple[list[float], str]:
    run_dir = tmp_path / name
    code, out, err = run_in_process(*overrides, f"trainer.max_steps={STEPS}",
                                    f"run.dir={run_dir}")
    assert code == 0, err
    records = read_metrics(run_dir)
    return [records[step]["train/loss"] for step in range(1, STEPS + 1)], out


def _assert_same_training(whole: list[float], pieces: list[float], rows: int) -> None:
    # Accumulating pieces only reorders the sums of the loss and gradients over the rows.
    rtol = loss_rtol(torch.float32, STEPS, rows * 32)
    assert whole == pytest.approx(pieces, rel=rtol, abs=0), (whole, pieces)


def test_the_step_splits_each_shards_rows_into_micro_batches():
    from types import SimpleNamespace

    from tpu_train.parallel.mesh import MeshShape
    from tpu_train.trainer.errors import ConfigError
    from tpu_train.trainer.layouts import Layout, SingleDevice
    from tpu_train.trainer.world import World

    def trainer(accum, micro):
        return SimpleNamespace(grad_accum_steps=accum, micro_batch_size=micro)

    one = SingleDevice(MeshShape(1, 1, 1), World(0, 1), torch.device("cpu"))
    assert one.step_splits(trainer(1, None), 16) == 1
    assert one.step_splits(trainer(1, 2), 16) == 8
    assert one.step_splits(trainer(3, 4), 16) == 12  # each of the 3 loader batches in 4 pieces
    assert one.step_splits(trainer(2, 16), 16) == 2
    # 16 rows over data=2 x fsdp=4: 2 rows per shard
    eight = Layout(MeshShape(2, 4, 1), World(0, 1), torch.device("cpu"))
    assert eight.step_splits(trainer(1, 1), 16) == 2
    assert eight.step_splits(trainer(1, None), 16) == 1
    with pytest.raises(ConfigError, match="micro_batch_size=4 must divide the 2 rows"):
        eight.step_splits(trainer(1, 4), 16)


@pytest.mark.devices(8)
def test_compiled_step_over_micro_batches_trains_as_the_whole_batch(tmp_path):
    # 16 rows over the session's 8 virtual devices: 2 per shard, 1 at a time.
    settings = [*TINY_COMPILED, "data.batch_size=16"]
    whole, _ = _losses(tmp_path, "whole", *settings)
    pieces, out = _losses(tmp_path, "pieces", *settings, "trainer.micro_batch_size=1")
    assert "(2 rows per data-parallel shard, 1 at a time)" in out, out[:2000]
    _assert_same_training(whole, pieces, 16)


def test_eager_step_over_micro_batches_trains_as_the_whole_batch(tmp_path):
    whole, _ = _losses(tmp_path, "whole", *TINY)
    pieces, out = _losses(tmp_path, "pieces", *TINY, "trainer.micro_batch_size=1")
    assert "(2 rows per data-parallel shard, 1 at a time)" in out, out[:2000]
    _assert_same_training(whole, pieces, 2)
