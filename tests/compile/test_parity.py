"""Compiled steps train exactly like eager PyTorch: CPU (the oracle) and the eager tpu device.

20 steps of the same data from the same weights; losses and final parameters must agree
within the float32 rounding of that computation (tests/tolerances.py): losses within
steps * rtol(longest reduction), parameters by an RMS bound per tensor (Adam: relative to the
total update lr * steps; SGD: relative to the accumulated update).
"""

import pytest
import torch

from tests import tolerances
from tests.tolerances import loss_rtol, rtol_for

from .helpers import (DEVICE, MLP_FUNCTIONS, MLP_N, OPTIMIZERS, TINY_LLAMA_FUNCTIONS,
                      assert_losses_close, assert_params_within, lm_batches, lm_loss, mlp,
                      mlp_batches, mlp_loss, param_bound, run_compiled, run_reference, tiny_llama)

STEPS = 20
F32 = torch.float32
# Longest reduction in each step (forward and backward): the MLP's mean-squared error over
# 8 x 5 outputs (its matmuls reduce over 12, 32 and the batch of 8); the tiny Llama's SwiGLU
# hidden size 176 (its other reductions: dim 64, vocab 128, 2 x 32 tokens, head dim 16).
LLAMA_N = 176
# The elementwise functions along each step: helpers.MLP_FUNCTIONS, TINY_LLAMA_FUNCTIONS.
LLAMA_FUNCTIONS = TINY_LLAMA_FUNCTIONS

@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_mlp_matches_cpu_and_eager_tpu(opt_name):
    model, make_opt, batches = mlp(), OPTIMIZERS[opt_name], mlp_batches(STEPS)
    cpu_losses, cpu_model, cpu_opt, _ = run_reference(model, make_opt, mlp_loss, batches,
                                                      device="cpu")
    eager_losses, eager_model, _, _ = run_reference(model, make_opt, mlp_loss, batches,
                                                    device=DEVICE)
    metrics, compiled_model, compiled_opt, step = run_compiled(model, make_opt, mlp_loss, batches)
    losses = [m["loss"] for m in metrics]
    loss_tol = loss_rtol(F32, STEPS, MLP_N, functions=MLP_FUNCTIONS)
    assert_losses_close(losses, cpu_losses, loss_tol)
    assert_losses_close(losses, eager_losses, loss_tol)
    bound = param_bound(opt_name, model, STEPS, MLP_N, functions=MLP_FUNCTIONS)
    assert_params_within(compiled_model, cpu_model, bound)
    assert_params_within(compiled_model, eager_model, bound)
    # The optimizer state is torch's own, updated in place: same keys, step counts and values.
    # exp_avg / momentum_buffer are running sums of gradients (rounding accumulates like the
    # loss's); exp_avg_sq sums squares (relative error doubles).
    state_rtol = 2 * loss_tol
    ours, theirs = compiled_opt.state_dict()["state"], cpu_opt.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for index in theirs:
        assert ours[index].keys() == theirs[index].keys()
        for key, value in theirs[index].items():
            if key == "step":
                assert float(ours[index][key]) == float(value) == STEPS
            else:
                tolerances.assert_rel_close(ours[index][key], value, state_rtol, f"{index}.{key}")
    assert len(step.compilations) == 1


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_tiny_llama_matches_cpu(opt_name):
    model, make_opt, batches = tiny_llama(), OPTIMIZERS[opt_name], lm_batches(STEPS)
    cpu_losses, cpu_model, _, _ = run_reference(model, make_opt, lm_loss, batches, device="cpu",
                                                max_grad_norm=1.0)
    metrics, compiled_model, _, step = run_compiled(model, make_opt, lm_loss, batches,
                                                    max_grad_norm=1.0)
    assert_losses_close([m["loss"] for m in metrics], cpu_losses,
                        loss_rtol(F32, STEPS, LLAMA_N, functions=LLAMA_FUNCTIONS))
    bound = param_bound(opt_name, model, STEPS, LLAMA_N, functions=LLAMA_FUNCTIONS)
    assert_params_within(compiled_model, cpu_model, bound)
    # The module's own tensors hold the update: state_dict and eager forward see it.
    state, cpu_state = compiled_model.state_dict(), cpu_model.state_dict()
    assert state.keys() == cpu_state.keys()
    assert_params_within(_Named(state), _Named(cpu_state), bound)
    # Logits: the forward's own rounding plus each parameter's relative error (the output of a
    # chain of (multi)linear maps and normalizations moves by at most the sum of its factors'
    # relative perturbations).
    logits_rtol = rtol_for(F32, LLAMA_N, functions=tolerances.llama_functions(2)) + sum(
        bound(name, q) * q.numel() ** 0.5 / float(q.detach().double().norm())
        for name, q in cpu_model.named_parameters())
    tokens = batches[0]["tokens"]
    eager_logits = compiled_model(tokens.to(DEVICE)).cpu()
    tolerances.assert_rel_close(eager_logits, cpu_model(tokens), logits_rtol, "logits")
    assert len(step.compilations) == 1


def test_tiny_llama_matches_eager_tpu():
    steps = 5  # the eager device runs op by op: a few steps prove the same trajectory
    model, make_opt, batches = tiny_llama(), OPTIMIZERS["adamw"], lm_batches(steps)
    eager_losses, eager_model, _, _ = run_reference(model, make_opt, lm_loss, batches,
                                                    device=DEVICE, max_grad_norm=1.0)
    metrics, compiled_model, _, _ = run_compiled(model, make_opt, lm_loss, batches,
                                                 max_grad_norm=1.0)
    assert_losses_close([m["loss"] for m in metrics], eager_losses,
                        loss_rtol(F32, steps, LLAMA_N, functions=LLAMA_FUNCTIONS))
    assert_params_within(compiled_model, eager_model,
                         param_bound("adamw", model, steps, LLAMA_N, functions=LLAMA_FUNCTIONS))


class _Named:
    """A state_dict seen through ``named_parameters`` (for assert_params_within)."""

    def __init__(self, state):
        self.state = state

    def named_parameters(self):
        return iter(self.state.items())


def test_metrics_are_device_tensors():
    batches = mlp_batches(1)
    model = mlp().to(DEVICE)
    from tpu_train.compile import compile_train_step

    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_loss)
    out = step({k: v.to(DEVICE) for k, v in batches[0].items()})
    assert set(out) == {"loss", "grad_norm", "lr"}
    for value in out.values():
        assert value.device.type == "tpu" and value.dim() == 0
    assert float(out["lr"].cpu()) == pytest.approx(0.1, rel=rtol_for(F32))  # one fp32 rounding
