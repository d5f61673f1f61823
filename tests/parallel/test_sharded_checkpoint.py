"""A sharded checkpoint saved under FSDP=8 restores onto TP=2 x FSDP=4 with the same next step.

The saved run is ``test_compiled_spmd``'s FSDP=8 run (10 AdamW steps, shared, not modified).
Restoring it onto a fresh step of the same layout gives the run's exact continuation; restoring
onto TP=2 x FSDP=4 must give the same values bit for bit and the same next-step loss.
"""

import copy

import jax
import numpy as np
import pytest
import torch

import tpu_train
from tpu_train.compile import compile_train_step
from tpu_train.device import storage_of
from tpu_train.models import LLAMA
from tpu_train.parallel import build_mesh, place_for_step, sharding_plan
from tpu_train.parallel.sharded_checkpoint import load_sharded, save_sharded, step_state

from tests.parallel.spmd_model import CFG, batches, init_model, loss_fn
from tests.parallel.test_compiled_spmd import MESHES, _train
from tests.tolerances import loss_rtol

# Meshes over the session's 8 virtual devices.
pytestmark = pytest.mark.devices(8)

DEVICE = tpu_train.device(0)


def _fresh_step(degrees):
    model = copy.deepcopy(init_model()).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    step = compile_train_step(model, opt, loss_fn,
                              mesh=build_mesh(*degrees, split_sizes=LLAMA.split_sizes(CFG)),
                              plan=sharding_plan(LLAMA))
    place_for_step(step)
    return step


def _host_values(step):
    return {k: np.asarray(s.buffer) for k, s in step_state(step).items()}


@pytest.mark.timeout(300)
def test_fsdp8_checkpoint_restores_onto_tp2_fsdp4(tmp_path):
    saved = _train(MESHES["fsdp8"])[3]
    before = _host_values(saved)
    path = save_sharded(tmp_path / "ckpt", saved)
    assert not (tmp_path / "ckpt.tmp").exists()
    # One file per process (here one), written from this process's devices' shards only.
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp"]
    assert _host_values(saved).keys() == before.keys()

    next_batch = {k: v.to(DEVICE) for k, v in batches(11)[10].items()}
    losses = {}
    for layout in ("fsdp8", "tp2_fsdp4"):
        step = _fresh_step(MESHES[layout])
        load_sharded(path, step)
        restored = _host_values(step)
        for key, value in before.items():
            np.testing.assert_array_equal(restored[key], value, err_msg=key)
        # The restored arrays keep the target layout.
        wq = storage_of(step.model.layers[0].attention.wq.weight).buffer
        assert len(wq.sharding.device_set) == 8
        assert step.adapter.step_count(step.optimizer.param_groups[0]) == 10
        losses[layout] = float(step(next_batch)["loss"])
    # Same values, same batch; only the order of the sharded sums differs between layouts:
    # one float32 step, longest reduction 128 (vocab, SwiGLU hidden, 8 x 16 tokens).
    assert losses["tp2_fsdp4"] == pytest.approx(losses["fsdp8"],
                                                rel=loss_rtol(torch.float32, 1, 128))


def test_restoring_a_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a sharded checkpoint"):
        load_sharded(tmp_path / "nothing", _train(MESHES["fsdp8"])[3])


def test_saving_over_an_existing_checkpoint_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FileExistsError, match="written once"):
        save_sharded(tmp_path / "ckpt", _train(MESHES["fsdp8"])[3])


def test_a_checkpoint_at_a_url_is_written_in_place_and_restores():
    """At a URL (an object store: no rename) the shards go straight there through DCP's
    fsspec writer, and come back through the restricted reader onto another layout; the
    trainer's meta.json, written last, marks the directory complete."""
    import fsspec

    from tpu_train.trainer.checkpoint import (SHARDED_DIR, checkpoint_dirs, verify_checkpoint,
                                              write_sharded_checkpoint)
    from tpu_train.trainer.storage_urls import run_path
    from tpu_train.trainer.world import World

    saved = _train(MESHES["fsdp8"])[3]
    before = _host_values(saved)
    run_dir = run_path(f"memory://sharded-{id(saved)}")
    checkpoints = run_dir / "checkpoints"
    final = write_sharded_checkpoint(checkpoints, 10, lambda path: save_sharded(path, saved),
                                     {"note": torch.tensor([1])}, World(rank=0, size=1))
    assert str(final) == f"{run_dir}/checkpoints/step_00000010"
    memory = fsspec.filesystem("memory")
    written = sorted(p.rsplit("/", 1)[1] for p in memory.find(final.path))
    assert written == [".metadata", "__0_0.distcp", "meta.json", "training_state.pt"]
    assert verify_checkpoint(final) is None and checkpoint_dirs(run_dir) == [(10, final)]
    with pytest.raises(FileExistsError, match="written once"):
        save_sharded(final / SHARDED_DIR, saved)

    step = _fresh_step(MESHES["tp2_fsdp4"])
    load_sharded(final / SHARDED_DIR, step)
    for key, value in _host_values(step).items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)
    memory.rm(final.path, recursive=True)
