"""A model family of the user's own, added through the public registry only, trains with
``tpu-train``: compiled, FSDP and tensor parallel on the session's 8 virtual devices, with the
losses of the same command on one device.

The family (tests/models/toy_family.py: residual MLP blocks under ``model.blocks``, its own
parameter names) is nothing the package knows; the trainer finds it by ``model.name``, the
parallel layer shards it from its parameter roles.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.platforms import cpu_child_env
from tests.tolerances import loss_rtol
from tests.trainer.cli_helpers import ROOT, read_metrics, run_in_process

STEPS = 4
# fp32 rounding of STEPS steps, longest reduction the 512-row vocabulary head, 2 blocks deep.
REL = loss_rtol(torch.float32, STEPS, reduction=512, depth=2)
COMMON = [
    "recipe=llama_pretrain", "model.name=toy_mlp_tiny", "data.batch_size=8",
    "data.seq_len=32", "trainer.val_every_n_steps=0", "logging.progress_bar=false",
    "logging.every_n_steps=1", "checkpoint.export_hf=false", "scheduler.warmup_steps=1",
    f"trainer.max_steps={STEPS}", "trainer.mode=compiled", "trainer.device=tpu",
]
# A child process on one virtual device that registers the family, then runs the command.
_ONE_DEVICE = ("import sys\n"
               "from tests.models.toy_family import TOY\n"
               "from tpu_train.models import register_family\n"
               "register_family(TOY)\n"
               "from tpu_train import cli\n"
               "sys.argv = ['tpu-train', *sys.argv[1:]]\n"
               "cli.main()\n")


@pytest.fixture
def toy_family():
    from tests.models.toy_family import TOY
    from tpu_train.models import register_family, unregister_family

    yield register_family(TOY)
    unregister_family(TOY.name)


def _losses(run_dir: Path) -> list[float]:
    metrics = read_metrics(run_dir)
    return [metrics[step]["train/loss"] for step in range(1, STEPS + 1)]


def _param_bytes(run_dir: Path) -> float:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "system/param_bytes_per_device" in record:
            return record["system/param_bytes_per_device"]
    raise AssertionError("no system/param_bytes_per_device in metrics.jsonl")


@pytest.mark.devices(8)
def test_a_family_of_ones_own_trains_sharded_like_one_device(toy_family, tmp_path):
    run_dir = tmp_path / "sharded"
    code, out, err = run_in_process(*COMMON, "parallel.data=2", "parallel.fsdp=2",
                                    "parallel.tensor=2", f"run.dir={run_dir}")
    assert code == 0, err
    assert "mesh data=2 fsdp=2 tensor=2 (8 devices, 1 process), SPMD plan toy_mlp_plan" in out
    sharded = _losses(run_dir)

    reference = tmp_path / "one_device"
    env = cpu_child_env(ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                        XLA_FLAGS="--xla_force_host_platform_device_count=1")
    done = subprocess.run([sys.executable, "-c", _ONE_DEVICE, *COMMON, "parallel.data=-1",
                           f"run.dir={reference}"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mesh data=1 fsdp=1 tensor=1 (1 device, 1 process)" in done.stdout
    alone = _losses(reference)
    assert alone[-1] < alone[0]  # it trained: not copies of one loss
    assert sharded == pytest.approx(alone, rel=REL)
    # Every weight is split 4 ways (fsdp x tensor; the norm scales 2 ways by fsdp): parameters
    # and AdamW moments per device well under half of one device's.
    assert _param_bytes(run_dir) <= 0.3 * _param_bytes(reference), (
        _param_bytes(run_dir), _param_bytes(reference))


def test_a_family_without_a_hugging_face_format_cannot_export(toy_family, tmp_path):
    overrides = [c for c in COMMON if not c.startswith("checkpoint.export_hf")]
    code, _, err = run_in_process(*overrides, "checkpoint.export_hf=true",
                                  f"run.dir={tmp_path / 'run'}")
    assert code != 0
    assert ("checkpoint.export_hf=true, but model family toy_mlp has no Hugging Face format; "
            "set checkpoint.export_hf=false") in err
    assert not (tmp_path / "run").exists()
