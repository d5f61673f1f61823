"""Adam/AdamW with bfloat16 moments (``tpu_train.compile.stored_moments``), eager and compiled.

Oracle: ``torch.optim.AdamW`` on the CPU with its moments rounded to bfloat16 after every step
(the same float32 arithmetic, the same stored values), and the plain float32-moment run, which
the bf16 one must follow within a bound derived from bf16's rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.compile.helpers import (MLP_FUNCTIONS, MLP_N, mlp, mlp_batches, mlp_loss,
                                   relative_error, run_compiled, run_reference)
from tests.tolerances import loss_rtol, unit_roundoff
from tpu_train.compile.functional_optim import AdamAdapter, adapter_for
from tpu_train.compile.stored_moments import AdamStoredMoments, AdamWStoredMoments

STEPS = 10
LR, BETAS, WEIGHT_DECAY = 3e-3, (0.9, 0.999), 0.1
MOMENTS = ("exp_avg", "exp_avg_sq")


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                             foreach=False)


def adamw_bf16(params):
    return AdamWStoredMoments(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                              state_dtype=torch.bfloat16)


class AdamWRoundedMoments(torch.optim.AdamW):
    """The oracle: torch's own AdamW step, then its moments rounded to bfloat16 (kept float32)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for state in self.state.values():
            for key in MOMENTS:
                state[key].copy_(state[key].to(torch.bfloat16))
        return loss


def adamw_rounded(params):
    return AdamWRoundedMoments(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                               foreach=False)


def moment_bytes(optimizer) -> int:
    return sum(state[key].nbytes for state in optimizer.state.values() for key in MOMENTS)


def bf16_moments_loss_bound(grad_norms, n_params: int, lr: float = LR,
                            betas: tuple[float, float] = BETAS) -> list[float]:
    """How far step k's loss may move from the float32-moment run's when the moments are
    rounded to bf16 each step (``grad_norms``: that run's gradient norm at each step).

    A stored moment differs from the float32 one by at most u (bf16's unit roundoff) of its
    magnitude per step, compounded over the steps: at step j the update's relative error is
    at most j * (u + u / 2) (``exp_avg`` and the square root of ``exp_avg_sq``). Adam's update
    per element is at most lr * (1 - beta1) / sqrt(1 - beta2) (bias-corrected, as the moments
    fill), so after k steps a parameter moved by at most lr * c * 1.5u * k(k + 1) / 2 away
    from the float32 run, and the loss by the gradient norm times that vector's norm (twice
    the gradient norm measured at the float32 run's point: slack for the curvature between).
    """
    u = unit_roundoff(torch.bfloat16)
    c = (1 - betas[0]) / (1 - betas[1]) ** 0.5
    bounds = []
    for k, grad_norm in enumerate(grad_norms):
        # Step k+1's loss is evaluated at the parameters after k updates.
        per_element = lr * c * 1.5 * u * k * (k + 1) / 2
        bounds.append(2 * grad_norm * per_element * n_params ** 0.5)
    return bounds


def test_eager_step_is_torch_adamw_with_moments_rounded_to_bf16():
    batches = mlp_batches(STEPS)
    model = mlp()
    losses, trained, opt, _ = run_reference(model, adamw_bf16, mlp_loss, batches, device="cpu")
    oracle, oracle_model, oracle_opt, _ = run_reference(model, adamw_rounded, mlp_loss, batches,
                                                        device="cpu")
    assert losses == oracle
    for p, q in zip(trained.parameters(), oracle_model.parameters()):
        assert torch.equal(p, q)
        for key in MOMENTS:
            stored = opt.state[p][key]
            assert stored.dtype == torch.bfloat16
            assert torch.equal(stored.float(), oracle_opt.state[q][key])


def _grad_norms(model, batches) -> list[float]:
    """The float32 run's gradient norm at each step's parameters (re-run, step by step)."""
    model, opt, norms = copy.deepcopy(model), None, []
    opt = adamw(model.parameters())
    for batch in batches:
        mlp_loss(model, batch).backward()
        norms.append(float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def test_bf16_moments_follow_fp32_moments_within_the_derived_bound_and_halve_the_bytes():
    batches = mlp_batches(STEPS)
    model = mlp()
    fp32, _, fp32_opt, _ = run_reference(model, adamw, mlp_loss, batches, device="cpu")
    bf16, _, bf16_opt, _ = run_reference(model, adamw_bf16, mlp_loss, batches, device="cpu")
    n_params = sum(p.numel() for p in model.parameters())
    bounds = bf16_moments_loss_bound(_grad_norms(model, batches), n_params)
    for k, (a, e, bound) in enumerate(zip(bf16, fp32, bounds)):
        assert abs(a - e) <= bound, f"step {k + 1}: {a} vs {e}, bound {bound:.2e}"
    assert bf16 != fp32  # the option took effect: rounded moments change the trajectory
    assert moment_bytes(bf16_opt) * 2 == moment_bytes(fp32_opt)


def test_compiled_step_stores_bf16_moments_and_matches_the_oracle():
    batches = mlp_batches(STEPS)
    model = mlp()
    metrics, _, opt, step = run_compiled(model, adamw_bf16, mlp_loss, batches)
    assert isinstance(step.adapter, AdamAdapter)
    assert dict(step.adapter.static_settings(opt.param_groups[0]))["state_dtype"] == \
        "torch.bfloat16"
    oracle, _, oracle_opt, _ = run_reference(model, adamw_rounded, mlp_loss, batches,
                                             device="cpu")
    # The same arithmetic as the eager step in float32 (RTOL of tests/compile/test_any_optimizer);
    # where float32 rounding differs by an ulp a moment may round to the neighbouring bf16 value,
    # at most u_bf16 of it, which the bound of the fp32-vs-bf16 test covers.
    rtol = loss_rtol(torch.float32, STEPS, MLP_N, functions=MLP_FUNCTIONS + ("sqrt",))
    n_params = sum(p.numel() for p in model.parameters())
    bounds = bf16_moments_loss_bound(_grad_norms(model, batches), n_params)
    for k, (m, e) in enumerate(zip(metrics, oracle)):
        assert abs(m["loss"] - e) <= rtol * abs(e) + bounds[k], f"step {k + 1}"
    # Both dicts hold the parameters in the model's order (created by the first step).
    for index, (state, oracle_state) in enumerate(zip(opt.state.values(),
                                                      oracle_opt.state.values())):
        for key in MOMENTS:
            assert state[key].dtype == torch.bfloat16
            error = relative_error(state[key].cpu().float(), oracle_state[key])
            assert error <= 4 * unit_roundoff(torch.bfloat16), f"param {index} {key}: {error}"


@pytest.mark.parametrize("cls", [AdamStoredMoments, AdamWStoredMoments])
def test_state_dict_round_trip_keeps_bf16_moments_exactly(cls):
    model = mlp()
    opt = cls(model.parameters(), lr=LR, state_dtype=torch.bfloat16)
    for batch in mlp_batches(2):
        mlp_loss(model, batch).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    fresh = cls(model.parameters(), lr=LR, state_dtype=torch.bfloat16)
    fresh.load_state_dict(saved)  # torch casts floating state to the parameters' dtype
    for p in model.parameters():
        for key in MOMENTS:
            assert fresh.state[p][key].dtype == torch.bfloat16
            assert torch.equal(fresh.state[p][key], opt.state[p][key])
    assert isinstance(adapter_for(fresh), AdamAdapter)


class Scale(torch.nn.Module):
    """``loss = sum(weight * x)``: the gradient is ``x`` exactly, in the weight's dtype."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(3)
        self.weight = torch.nn.Parameter(torch.randn(64, 16).to(dtype))

    def forward(self, x):
        return (self.weight * x).sum()


def scale_loss(model, batch):
    return model(batch["x"])


def _bf16_gradients(n: int) -> list[dict]:
    torch.manual_seed(4)
    return [{"x": torch.randn(64, 16).to(torch.bfloat16)} for _ in range(n)]


def test_bf16_weights_with_fp32_moments_update_in_fp32():
    """``state_dtype=torch.float32`` over bf16 weights: each step is torch's AdamW on a float32
    copy of the weight, with float32 moments, rounded back to bf16 once (eager: exactly that;
    compiled: within one bf16 rounding of it)."""
    batches = _bf16_gradients(STEPS)
    weight = Scale(torch.bfloat16).weight.detach().float()
    oracle = torch.nn.Parameter(weight.clone())
    oracle_opt = adamw([oracle])
    for batch in batches:
        oracle.grad = batch["x"].float()
        oracle_opt.step()
        with torch.no_grad():
            oracle.copy_(oracle.to(torch.bfloat16))

    def make(params):
        return AdamWStoredMoments(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                                  state_dtype=torch.float32)

    _, eager, eager_opt, _ = run_reference(Scale(torch.bfloat16), make, scale_loss, batches,
                                           device="cpu")
    assert eager.weight.dtype == torch.bfloat16
    assert torch.equal(eager.weight.float(), oracle.detach())
    assert eager_opt.state[eager.weight]["exp_avg"].dtype == torch.float32
    _, compiled, compiled_opt, _ = run_compiled(Scale(torch.bfloat16), make, scale_loss, batches)
    assert compiled_opt.state[compiled.weight]["exp_avg_sq"].dtype == torch.float32
    ulp = oracle.detach().abs() * 2 * unit_roundoff(torch.bfloat16)
    assert ((compiled.weight.cpu().float() - oracle.detach()).abs() <= ulp).all()
    # Not the bf16 arithmetic of plain AdamW over bf16 weights (the option took effect).
    _, plain, _, _ = run_reference(Scale(torch.bfloat16), adamw, scale_loss, batches,
                                   device="cpu")
    assert not torch.equal(plain.weight, eager.weight)
