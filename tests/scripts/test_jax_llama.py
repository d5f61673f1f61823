"""scripts/jax_llama.py, the hand-written JAX yardstick, trains the project's Llama as PyTorch
on the CPU does: same losses and gradient norms step by step, float32 and bf16."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tolerances import loss_rtol, rtol_for
from tpu_train.models import Llama
from tpu_train.trainer.optim import parameter_groups

ROOT = Path(__file__).resolve().parents[2]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


jax_llama = _load_script("jax_llama")
TINY = jax_llama.Size("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128,
                      vocab_size=256, batch=2, seq=32)
HYPER = jax_llama.Hyper(lr=1e-3)
STEPS = 4
# Float32: the longest reduction is the vocabulary's softmax sum (256) or the SwiGLU hidden
# (128); the loss after n steps within loss_rtol(n), a chain of 2 layers.
F32_TOL = [loss_rtol(torch.float32, n, TINY.vocab_size, depth=2) for n in range(1, STEPS + 1)]
# bf16: products round inputs and outputs to bf16 and the reference also keeps the residual
# stream in bf16 (PyTorch's autocast leaves it float32): per layer two bf16 products and two
# bf16 residual additions, plus the head; the float32 master weights make each step's
# rounding enter that step's loss anew (tests/tolerances.py, "Mixed precision").
BF16_TOL = loss_rtol(torch.bfloat16, 1, 1, depth=4 * TINY.n_layers + 1)


def _batches(size=TINY):
    rng = np.random.default_rng(3)
    pool = []
    for _ in range(2):  # two fixed batches, alternated: the loss falls visibly in 4 steps
        t = rng.integers(0, size.vocab_size, size=(size.batch, size.seq + 1))
        pool.append({"tokens": t[:, :-1], "labels": t[:, 1:]})
    return [pool[i % 2] for i in range(STEPS)]


def _model():
    model = Llama(TINY.config())
    model.init_weights(seed=0, device="cpu")
    return model


def _torch_run(model, precision: str):
    """Losses and gradient norms of the trainer's recipe (AdamW on its parameter groups,
    clipping to 1.0) in plain PyTorch on the CPU, bf16 as ``torch.autocast``."""
    opt = torch.optim.AdamW(parameter_groups(model, HYPER.weight_decay), lr=HYPER.lr,
                            betas=(HYPER.b1, HYPER.b2), eps=HYPER.eps)
    losses, norms = [], []
    for batch in _batches():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(torch.from_numpy(batch["tokens"]))
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 torch.from_numpy(batch["labels"]).flatten())
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, norms


def _jax_run(model, precision: str):
    import jax

    ref = jax_llama.Reference(model, TINY, HYPER, jax.devices("cpu")[0], precision=precision)
    losses, norms = [], []
    for batch in _batches():
        loss, norm = ref.step(batch)
        losses.append(float(loss))
        norms.append(float(norm))
    return losses, norms


@pytest.fixture(scope="module")
def torch_f32():
    return _torch_run(_model(), "fp32")


def test_fp32_losses_and_grad_norms_match_pytorch(torch_f32):
    losses, norms = _jax_run(_model(), "fp32")
    want_losses, want_norms = torch_f32
    assert want_losses[-1] < want_losses[0] - 0.05  # it trains
    for i, tol in enumerate(F32_TOL):
        assert math.isclose(losses[i], want_losses[i], rel_tol=tol), (i, losses, want_losses)
        # The gradient norm is a reduction over every parameter of a step's gradients.
        assert math.isclose(norms[i], want_norms[i], rel_tol=tol * 4), (i, norms, want_norms)


def test_bf16_losses_match_pytorch_autocast():
    losses, _ = _jax_run(_model(), "bf16")
    want, _ = _torch_run(_model(), "bf16")
    for i in range(STEPS):
        assert math.isclose(losses[i], want[i], rel_tol=BF16_TOL), (i, losses, want)
    assert losses[-1] < losses[0] - 0.05


def test_bf16_step_keeps_f32_masters_and_bf16_dots():
    """Weights and optimizer state stay float32; the dots run on bf16 operands."""
    import jax

    model = _model()
    ref = jax_llama.Reference(model, TINY, HYPER, jax.devices("cpu")[0], precision="bf16")
    batch = _batches()[0]
    text = ref.step_fn.lower(ref.params, ref.opt_state, batch["tokens"].astype(np.int32),
                             batch["labels"].astype(np.int32), ref.cos, ref.sin).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots and all("bf16>" in line.split("->")[0] for line in dots), dots[:3]
    ref.step(batch)
    leaves = jax.tree.leaves((ref.params, ref.opt_state))
    assert {str(leaf.dtype) for leaf in leaves if leaf.ndim} == {"float32"}


def test_bad_precision_and_remat_are_one_line_errors():
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16"):
        jax_llama.make_train_step(TINY.config(), None, precision="fp16")
    with pytest.raises(ValueError, match="remat must be one of"):
        jax_llama.make_train_step(TINY.config(), None, remat="some")


def test_param_shapes_match_the_torch_model():
    model = _model()
    host = jax_llama.params_from_torch(model)
    assert {n: a.shape for n, a in host.items()} == jax_llama.param_shapes(model.config)
    assert sum(a.size for a in host.values()) == sum(p.numel() for p in model.parameters())


def test_1b_size_has_over_0_8b_parameters():
    from tpu_train.models.llama.config import num_params

    assert num_params(jax_llama.SIZES["1b"].config()) >= 0.8e9
    assert jax_llama.SIZES["1b"].seq == 2048


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trainer_compiled_step_matches_reference(precision):
    """What ``bench_train_step.py --size`` compares: the step ``tpu-train`` builds for
    ``trainer.precision`` against the reference with the optimizer settings of that config."""
    import jax

    modes = _load_script("train_step_modes")
    cfg = modes.trainer_config(precision)
    assert cfg.trainer.precision.value == precision and cfg.trainer.max_grad_norm == 1.0
    # The trainer spreads the batch over every device (8 virtual CPU devices here): 8 rows.
    size = dataclasses.replace(TINY, batch=jax.device_count())
    compiled = modes.TrainerMode(_model(), cfg)
    reference = modes.ReferenceMode(_model(), size, modes.hyper_from(cfg), precision)
    for i, batch in enumerate(_batches(size)):
        got, want = float(compiled.step(batch)), float(reference.step(batch))
        tol = F32_TOL[i] if precision == "fp32" else BF16_TOL
        assert math.isclose(got, want, rel_tol=tol), (i, got, want)
    assert compiled.stages["compilations"] == 1


jax_llama_scan = _load_script("jax_llama_scan")


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_the_scanned_reference_trains_as_pytorch(torch_f32, remat):
    """scripts/jax_llama_scan.py (layers under one scan, each under a remat policy) is the same
    model and optimizer: the same fp32 losses and gradient norms as PyTorch step by step."""
    import jax

    ref = jax_llama_scan.ScanReference(_model(), TINY, HYPER, jax.devices("cpu")[0],
                                       precision="fp32", remat=remat)
    assert set(ref.params["layers"]["attention.wq.weight"].shape) == {2, 64}  # [L, in, out]
    want_losses, want_norms = torch_f32
    for i, batch in enumerate(_batches()):
        loss, norm = ref.step(batch)
        assert math.isclose(float(loss), want_losses[i], rel_tol=F32_TOL[i]), (i, loss)
        assert math.isclose(float(norm), want_norms[i], rel_tol=F32_TOL[i] * 4), (i, norm)
