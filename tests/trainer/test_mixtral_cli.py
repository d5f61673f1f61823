"""``tpu-train`` with Mixtral: a transformers-written checkpoint fine-tuned and exported, and
expert parallelism (``parallel.expert``) on the session's 8 virtual devices against one
device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models.test_mixtral import hf_mixtral_dir
from tests.platforms import cpu_child_env
from tests.tolerances import loss_rtol
from tests.trainer.cli_helpers import TINY, one_thread, read_metrics, run_in_process  # noqa: F401
from tpu_train.trainer.config import ASSETS_DIR

transformers = pytest.importorskip("transformers")

STEPS = 4
# Sharded programs differ from one device's in how their sums are split: fp32 rounding over
# STEPS steps of mixtral_tiny (2 layers; longest reduction the 96-wide experts x 8 experts).
REL = loss_rtol(torch.float32, STEPS, reduction=96 * 8, depth=2)
COMPILED = [
    "recipe=llama_pretrain", "model=mixtral_tiny", "data.batch_size=8", "data.seq_len=32",
    "trainer.val_every_n_steps=0", "logging.progress_bar=false", "logging.every_n_steps=1",
    "checkpoint.export_hf=false", "scheduler.warmup_steps=1", f"trainer.max_steps={STEPS}",
    "trainer.mode=compiled", "trainer.device=tpu",
]


def _losses(run_dir: Path) -> list[float]:
    metrics = read_metrics(run_dir)
    return [metrics[step]["train/loss"] for step in range(1, STEPS + 1)]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one_device") / "run"
    env = cpu_child_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                        XLA_FLAGS="--xla_force_host_platform_device_count=1")
    done = subprocess.run([sys.executable, "-m", "tpu_train.cli", *COMPILED, "parallel.data=-1",
                           f"run.dir={run_dir}"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = _losses(run_dir)
    assert losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize("layout", [
    ["parallel.data=-1", "parallel.expert=2"],
    ["parallel.data=1", "parallel.fsdp=2", "parallel.expert=4"],
    # the grouped expert form (ragged_dot, differentiated by JAX) against the dense one
    ["model.moe_impl=grouped", "parallel.data=-1", "parallel.expert=2"],
    # each sequence split over `context` as well (the zig-zag layout's position_ids reach the
    # forward that returns the load-balancing loss)
    ["parallel.data=1", "parallel.fsdp=2", "parallel.context=2", "parallel.expert=2"],
], ids=["expert2_data4", "expert4_fsdp2", "grouped_expert2_data4", "context2_expert2_fsdp2"])
def test_expert_parallel_losses_match_one_device(one_device, layout, tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*COMPILED, *layout, f"run.dir={run_dir}")
    assert code == 0, err
    shown = [s.split(".", 1)[1] for s in layout
             if s.startswith(("parallel.expert=", "parallel.context="))]
    assert all(f" {s}" in out for s in shown) and "SPMD plan mixtral_plan" in out
    torch.testing.assert_close(torch.tensor(_losses(run_dir)), torch.tensor(one_device),
                               rtol=REL, atol=0)


def test_expert_weights_are_split_over_the_expert_axis():
    import jax

    from tpu_train.models import MIXTRAL
    from tpu_train.parallel.family_plans import sharding_plan
    from tpu_train.parallel.mesh import build_mesh

    mesh = build_mesh(data=2, fsdp=1, tensor=1, expert=4, devices=jax.devices()[:8])
    shapes = MIXTRAL.param_shapes(MIXTRAL.config("mixtral_tiny"))
    shardings = sharding_plan(MIXTRAL).shardings(
        {n: jax.ShapeDtypeStruct(s, "float32") for n, s in shapes.items()}, mesh)
    w1 = shardings["layers.0.feed_forward.w1"]
    assert w1.shard_shape(shapes["layers.0.feed_forward.w1"]) == (2, 96, 64)  # 8 experts / 4
    assert shardings["layers.0.attention.wq.weight"].is_fully_replicated


def test_finetunes_a_transformers_mixtral_and_exports_it(tmp_path, one_thread):
    from tpu_train.models.mixtral import from_pretrained

    checkpoint = tmp_path / "mixtral"
    original = hf_mixtral_dir(checkpoint, vocab_size=512)
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(
        "recipe=llama_finetune", f"model.checkpoint={checkpoint}",
        f"data.tokenizer={ASSETS_DIR / 'tokenizer'}", *TINY, "trainer.max_steps=3",
        "checkpoint.export_hf=true", f"run.dir={run_dir}")
    assert code == 0, err
    assert "step 3/3" in out
    export = run_dir / "hf"
    reloaded = transformers.MixtralForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert not torch.equal(dict(reloaded.named_parameters())[name],
                           dict(original.named_parameters())[name])  # it trained the experts
    ours = from_pretrained(export).eval()
    tokens = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reloaded(tokens).logits, atol=1e-4, rtol=0)
