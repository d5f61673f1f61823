"""Any ``torch.optim`` optimizer in ``compile_train_step``: the optimizer's own ``step()`` traced.

Oracle: the same optimizer class in eager PyTorch on the CPU, from the same weights and batches,
with an LR scheduler that changes the learning rate every step. Each case trains a tiny MLP for
10 steps and checks the losses, the final parameters and the optimizer state against the
oracle, and that the step compiled once (the learning rate is a program input).
"""

from __future__ import annotations

import pytest
import torch

from tests.compile.helpers import (DEVICE, MLP_FUNCTIONS, MLP_N, mlp, mlp_batches, mlp_loss,
                                   relative_error, run_compiled, run_reference)
from tests.tolerances import loss_rtol, update_rtol
from tpu_train.compile import compile_train_step
from tpu_train.compile.functional_optim import (AdamAdapter, SGDAdapter,
                                                UnsupportedOptimizerError, adapter_for)
from tpu_train.compile.traced_optim import TracedOptimizerAdapter

STEPS = 10
# Losses and parameters (normwise) after STEPS steps of one computation implemented twice:
# tests/tolerances.py's STEPS x the rounding of the MLP's longest reduction (MSE over 8 x 5),
# its GELU's erf, its tanh and the optimizers' square roots, as measured on the test platform.
RTOL = loss_rtol(torch.float32, STEPS, MLP_N, functions=MLP_FUNCTIONS + ("sqrt",))
# The optimizer state (normwise) after the same steps: running sums or averages of the
# gradients (exp_avg, momentum_buffer, grad_avg, ax), linear in them, so within the accumulated
# error of an optimizer linear in the gradient (update_rtol), or of their squares (exp_avg_sq,
# square_avg, sum, acc_delta), where the square doubles the relative error.
STATE_RTOL = 2 * update_rtol(torch.float32, STEPS, MLP_N, functions=MLP_FUNCTIONS + ("sqrt",))


class SignMomentum(torch.optim.Optimizer):
    """A user-defined optimizer: sign-SGD on a bias-corrected momentum buffer, decoupled weight
    decay, a tensor step counter — written the way torch's docs show custom optimizers."""

    def __init__(self, params, lr=1e-3, beta=0.9, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, beta=beta, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta = group["beta"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["buf"] = torch.zeros_like(p)
                state["step"] += 1
                buf = state["buf"]
                buf.mul_(beta).add_(p.grad, alpha=1 - beta)
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(buf / (1 - beta ** state["step"])), alpha=-group["lr"])


class AdamWOwnStep(torch.optim.AdamW):
    """Its own step (so not AdamW's hand-written path) that runs the parent's."""

    def step(self, closure=None):
        return super().step(closure)


def _two_groups(params, cls, first: dict, second: dict):
    params = list(params)
    return cls([{"params": params[:2], **first}, {"params": params[2:], **second}])


# name -> (make the compiled side's optimizer, make the CPU oracle's optimizer or None if the same)
CASES = {
    "adam": (lambda ps: torch.optim.Adam(ps, lr=2e-3, betas=(0.8, 0.95), weight_decay=0.01), None),
    "adamw-amsgrad": (lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1, amsgrad=True),
                      None),
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
                     None),
    "sgd-nesterov": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                                dampening=0.0), None),
    "rmsprop-momentum": (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9,
                                                        weight_decay=0.01), None),
    "rmsprop-centered": (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True, alpha=0.95),
                         None),
    "adagrad-2-groups": (lambda ps: _two_groups(ps, torch.optim.Adagrad,
                                                {"lr": 0.05, "lr_decay": 0.01},
                                                {"lr": 0.02, "weight_decay": 0.1}), None),
    "adadelta": (lambda ps: torch.optim.Adadelta(ps, lr=1.0, rho=0.9, weight_decay=0.01), None),
    "nadam": (lambda ps: torch.optim.NAdam(ps, lr=2e-3, weight_decay=0.01), None),
    # capturable=True keeps the step counters on the device (torch refuses it on the CPU, so
    # the oracle runs the same optimizer without it).
    "nadam-capturable-decoupled": (
        lambda ps: torch.optim.NAdam(ps, lr=2e-3, weight_decay=0.1, decoupled_weight_decay=True,
                                     capturable=True),
        lambda ps: torch.optim.NAdam(ps, lr=2e-3, weight_decay=0.1, decoupled_weight_decay=True)),
    "radam": (lambda ps: torch.optim.RAdam(ps, lr=2e-3, weight_decay=0.01), None),
    "asgd": (lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=3, weight_decay=0.01), None),
    "adamax-foreach": (lambda ps: torch.optim.Adamax(ps, lr=2e-3, foreach=True), None),
    "user-sign-momentum": (lambda ps: SignMomentum(ps, lr=1e-3, beta=0.9, weight_decay=0.1), None),
    # A subclass with its own step() that calls the parent's: traced, through torch's
    # step() wrapper of the parent (profiler range included).
    "user-adamw-subclass": (lambda ps: AdamWOwnStep(ps, lr=3e-3, weight_decay=0.1),
                            lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1)),
}
HAND_WRITTEN = {"adam", "adamw-amsgrad", "sgd-momentum", "sgd-nesterov"}


def _schedule(opt):
    # A different learning rate every step: it must reach the program as an input.
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))


@pytest.mark.parametrize("case", list(CASES))
def test_optimizer_matches_eager_cpu(case):
    make, make_oracle = CASES[case]
    model, batches = mlp(), mlp_batches(STEPS)
    ref_losses, ref_model, ref_opt, ref_lrs = run_reference(
        model, make_oracle or make, mlp_loss, batches, device="cpu", make_sched=_schedule)
    metrics, compiled_model, opt, step = run_compiled(model, make, mlp_loss, batches,
                                                      make_sched=_schedule)

    expected_adapter = (AdamAdapter, SGDAdapter) if case in HAND_WRITTEN else TracedOptimizerAdapter
    assert isinstance(step.adapter, expected_adapter)
    assert len(step.compilations) == 1, [c.cause for c in step.compilations]
    assert [m["lr"] for m in metrics] == pytest.approx(ref_lrs, rel=1e-6)
    assert len(set(ref_lrs)) == STEPS
    for i, (m, expected) in enumerate(zip(metrics, ref_losses)):
        assert m["loss"] == pytest.approx(expected, rel=RTOL), f"step {i + 1}"
    for (name, p), q in zip(compiled_model.named_parameters(), ref_model.parameters()):
        assert relative_error(p, q) <= RTOL, name

    # The optimizer state is torch's own: the same keys, values and step counts as eager's.
    for p, q in zip(compiled_model.parameters(), ref_model.parameters()):
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert set(state) == set(ref_state)
        for key, value in ref_state.items():
            if key == "step":
                assert float(state[key].cpu()) == float(value) == STEPS
            else:
                assert relative_error(state[key], value) <= STATE_RTOL, key


def test_adapter_choice():
    params = [torch.nn.Parameter(torch.zeros(3))]

    class AdamWSubclass(torch.optim.AdamW):  # inherits step: still AdamW's hand-written path
        pass

    assert isinstance(adapter_for(AdamWSubclass(params)), AdamAdapter)
    assert isinstance(adapter_for(torch.optim.SGD(params, lr=0.1)), SGDAdapter)
    assert isinstance(adapter_for(AdamWOwnStep(params)), TracedOptimizerAdapter)
    assert isinstance(adapter_for(torch.optim.Adamax(params)), TracedOptimizerAdapter)


class _PlainLoop(torch.optim.Optimizer):
    """SGD over every parameter, with one per-parameter state rule left to the subclass."""

    def __init__(self, params):
        super().__init__(params, dict(lr=0.1))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(self.direction(p, self.state[p]), alpha=-group["lr"])


class _PythonCounter(_PlainLoop):
    def direction(self, p, state):
        state["step"] = state.get("step", 0) + 1  # a Python int: it would be baked if traced
        return p.grad


class _StateFromGradient(_PlainLoop):
    def direction(self, p, state):
        if "buf" not in state:
            state["buf"] = p.grad.clone()
        else:
            state["buf"].mul_(0.9).add_(p.grad)
        return state["buf"]


@pytest.mark.parametrize("cls, message", [
    (_PythonCounter, "keeps a int in its state under 'step'"),
    (_StateFromGradient, "creates its state 'buf' from the first gradient"),
])
def test_untraceable_state_is_a_clear_error(cls, message):
    model = mlp().to(DEVICE)
    step = compile_train_step(model, cls(model.parameters()), mlp_loss)
    batch = {k: v.to(DEVICE) for k, v in mlp_batches(1)[0].items()}
    with pytest.raises(UnsupportedOptimizerError, match=message):
        step(batch)
