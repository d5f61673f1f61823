"""The compiled step on workload W1 (``helpers.w1_llama``: the model the benchmark times).

W1: Llama-style decoder, dim 512, 4 layers, 8 / 4 heads, SwiGLU 1408, vocab 8192, batch 4 x 256,
causal-LM cross-entropy, AdamW (lr 1e-4, weight decay 0.1), no clipping. The runs are
expensive on a CPU client (seconds per step), so each is made once per module and shared:
CPU PyTorch (the oracle), eager tpu, compiled float32 (5 steps each) and compiled bf16
autocast. The data are two fixed batches, alternated, so that the loss falls visibly in 5
steps (9.12 -> 8.10 on CPU; random fresh batches leave it flat at ~log(8192) and prove little).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tpu_train.compile import dynamo_backend
from tests.tolerances import loss_rtol, param_atol

from .helpers import (DEVICE, assert_losses_close, assert_params_within, lm_batches, lm_functions,
                      lm_loss, run_compiled, run_reference, to_device, w1_llama)

# As a checkout used without `pip install` does; an installed tpu_train is also found through
# its entry point (test_backend_works_right_after_import_tpu_train).
dynamo_backend.register()

STEPS = 5
# torch.compile trains with the eager optimizer (op by op, ~37 tensors): a few steps show the
# same trajectory as eager execution at a fraction of the cost.
TORCH_COMPILE_STEPS = 3
LR = 1e-4
# Tolerances from the arithmetic (tests/tolerances.py). Float32: the longest reduction of a W1
# step is the softmax / LM-head sum over the vocabulary, 8192 (dim 512, SwiGLU 1408, 1024
# tokens); losses after n steps within loss_rtol(n), parameters within an RMS bound relative
# to the total AdamW update LR * STEPS.
# Each counts W1's elementwise functions (its 4 layers' and the cross-entropy's).
F32, VOCAB = torch.float32, 8192
FUNCTIONS = lm_functions(4)
LOSS_TOL = loss_rtol(F32, STEPS, VOCAB, functions=FUNCTIONS)
TORCH_COMPILE_LOSS_TOL = loss_rtol(F32, TORCH_COMPILE_STEPS, VOCAB, functions=FUNCTIONS)
# bf16 autocast: products round their inputs and output to bf16 and accumulate in float32
# (softmax, cross-entropy and norms stay float32), so each contributes bf16 roundings whatever
# its length (reduction 1), a chain of 4 layers deep; the weights and AdamW stay float32, so
# that rounding enters each step's loss anew (steps=1) and the trajectory only through
# LR x the gradient's error. See tests/tolerances.py, "Mixed precision".
BF16_LOSS_TOL = loss_rtol(torch.bfloat16, 1, 1, depth=4)


def _param_bound(name, ref):
    return param_atol(F32, LR, STEPS, reduction=VOCAB, numel=ref.numel(), functions=FUNCTIONS)


def w1_adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


@pytest.fixture(scope="module")
def w1():
    pool = lm_batches(2, batch=4, seq=256, vocab=8192, seed=5)
    return w1_llama(), [pool[i % 2] for i in range(STEPS)]


@pytest.fixture(scope="module")
def cpu_run(w1):
    model, batches = w1
    losses, trained, _, _ = run_reference(model, w1_adamw, lm_loss, batches, device="cpu")
    return losses, trained


@pytest.fixture(scope="module")
def eager_run(w1):
    model, batches = w1
    losses, trained, _, _ = run_reference(model, w1_adamw, lm_loss, batches, device=DEVICE)
    return losses, trained


@pytest.fixture(scope="module")
def compiled_fp32_run(w1):
    model, batches = w1
    metrics, trained, _, step = run_compiled(model, w1_adamw, lm_loss, batches)
    return [m["loss"] for m in metrics], trained, step


def test_w1_compiled_fp32_matches_cpu_and_eager_tpu(cpu_run, eager_run, compiled_fp32_run):
    cpu_losses, cpu_model = cpu_run
    eager_losses, eager_model = eager_run
    losses, model, step = compiled_fp32_run
    assert losses[-1] < losses[0] - 0.05, losses  # it trains
    assert_losses_close(losses, cpu_losses, LOSS_TOL)
    assert_losses_close(losses, eager_losses, LOSS_TOL)
    assert_params_within(model, cpu_model, _param_bound)
    assert_params_within(model, eager_model, _param_bound)
    assert len(step.compilations) == 1


def test_w1_bf16_autocast_loss_curve_tracks_float32(w1, compiled_fp32_run):
    model, batches = w1
    fp32_losses = compiled_fp32_run[0]
    metrics, _, _, step = run_compiled(model, w1_adamw, lm_loss, batches,
                                       autocast_dtype=torch.bfloat16)
    losses = [m["loss"] for m in metrics]
    assert_losses_close(losses, fp32_losses, BF16_LOSS_TOL)
    # Not vacuous: the program really multiplies in bf16.
    (entry,) = step.cache.entries.values()
    dots = {n.meta["val"].dtype for n in entry.grad_graph.graph.nodes
            if n.op == "call_function" and n.target in (torch.ops.aten.mm.default,
                                                        torch.ops.aten.bmm.default)}
    assert dots == {torch.bfloat16}


def test_w1_torch_compile_trains_like_eager(w1, eager_run):
    torch._dynamo.reset()
    model, batches = w1
    model = copy.deepcopy(model).to(DEVICE)
    compiled = torch.compile(model, backend="tpu")
    opt = w1_adamw(model.parameters())
    losses = []
    for batch in batches[:TORCH_COMPILE_STEPS]:
        loss = lm_loss(compiled, to_device(batch))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach().cpu()))
    assert_losses_close(losses, eager_run[0][:TORCH_COMPILE_STEPS], TORCH_COMPILE_LOSS_TOL)
