"""Strict mode runs a backward pass and a run of multi-tensor (``_foreach_*``) ops, an
optimizer's step, as one program before the next other op (lazy.batch_backward,
lazy.batch_multi_tensor); debug mode runs each op alone.

Oracle: the same steps in PyTorch on CPU, within the tolerances tests/tolerances.py derives
for the platform (a ReLU model: its functions are AdamW's sqrt and div).
"""

import copy
import threading

import pytest
import torch

import tpu_train
from tpu_train.device import lazy
from tests.tolerances import loss_rtol, param_atol

# The model's longest reduction: the loss's mean over 4 x 3 outputs.
REDUCTION, STEPS, LR = 12, 4, 0.05
FUNCTIONS = ("sqrt", "div")

TPU = torch.device("tpu", 0)


@pytest.fixture(autouse=True)
def records_backward_and_multi_tensor_runs():
    """These tests are of strict mode's recording of backward passes and multi-tensor runs
    alone, which the CPU client uses; a TPU records every op (test_strict_record_all.py)."""
    with lazy.strict_recording(False):
        yield


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _train(model, device, steps=3, clip=False, zero_grad_to_none=True, counts=None):
    """Losses and final parameters; ``counts`` gets lazy.stats() after the second step (an
    op's first call runs alone; step 2 is the first to add into zeroed gradients) and after
    the last."""
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    x = torch.linspace(-1, 1, 24).reshape(4, 6).to(device)
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad(set_to_none=zero_grad_to_none)
        losses.append(loss.detach())
        if counts is not None and len(losses) in (2, steps):
            counts.append(lazy.stats())
    return [float(v) for v in losses], [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("clip", [False, True], ids=["adamw", "clip_then_adamw"])
@pytest.mark.parametrize("zero_grad_to_none", [True, False], ids=["grads_none", "grads_zeroed"])
def test_an_optimizer_step_is_one_region_and_matches_cpu(clip, zero_grad_to_none):
    cpu_losses, cpu_params = _train(_model(), torch.device("cpu"), steps=STEPS, clip=clip,
                                    zero_grad_to_none=zero_grad_to_none)
    counts = []
    losses, params = _train(_model(), TPU, steps=STEPS, clip=clip,
                            zero_grad_to_none=zero_grad_to_none, counts=counts)
    ran = counts[1]["regions_run"] - counts[0]["regions_run"]
    recorded = counts[1]["ops_recorded"] - counts[0]["ops_recorded"]
    # Steps 3-4 record their backward pass (10 lowered ops; 14 where the gradients were
    # zeroed rather than set to None: AccumulateGrad adds into each), AdamW's 8 multi-tensor
    # ops (weight decay, lerp, mul, addcmul, sqrt, div, add, addcdiv) and clipping's two
    # (norms, scaling). Backward and update run as one region a step when the next op comes
    # (the next forward's); clipping's ordinary ops run the backward's region first, so two.
    backward = 10 if zero_grad_to_none else 14
    assert recorded == 2 * (backward + 8 + (2 if clip else 0))
    assert ran == 2 * (2 if clip else 1)
    assert_matches_cpu((losses, params), (cpu_losses, cpu_params))


def assert_matches_cpu(run, cpu_run):
    """:func:`_train`'s losses and parameters against CPU torch's, within the derived bounds."""
    (losses, params), (cpu_losses, cpu_params) = run, cpu_run
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), atol=0,
                               rtol=loss_rtol(torch.float32, STEPS, REDUCTION))
    for a, b in zip(params, cpu_params):
        limit = param_atol(torch.float32, LR, STEPS, reduction=REDUCTION, numel=b.numel(),
                           functions=FUNCTIONS)
        assert float((a - b).square().mean().sqrt()) <= limit


def test_the_next_op_and_a_view_see_the_update():
    w = torch.arange(6.0).to(TPU)
    v = w.view(2, 3)
    torch._foreach_mul_([w], 2.0)
    torch._foreach_add_([w], 1.0)
    assert lazy.deferred
    u = v[1] * 10  # an ordinary op on a view runs the recorded ones first
    assert not lazy.deferred
    assert u.cpu().tolist() == [70.0, 90.0, 110.0]
    torch._foreach_sub_([w], 1.0)
    assert w.cpu().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]  # a read runs them too


def test_the_autograd_thread_runs_what_the_main_thread_recorded():
    w = torch.ones(3, device=TPU, requires_grad=True)
    with torch.no_grad():
        torch._foreach_mul_([w], 3.0)
    threads = []

    def hook(grad):
        threads.append(threading.get_ident())
        return grad * 1.0  # an op on the engine's thread: it must see w's update

    loss = (w * w).sum()
    w.register_hook(hook)
    loss.backward()
    assert threads and threads[0] != threading.get_ident()
    assert w.grad.cpu().tolist() == [6.0, 6.0, 6.0]


def test_debug_mode_runs_each_multi_tensor_op_alone():
    w = torch.arange(3.0).to(TPU)
    with tpu_train.eager_mode("debug"):
        before = lazy.stats()
        torch._foreach_mul_([w], 2.0)
        torch._foreach_add_([w], 1.0)
        assert lazy.stats() == before and not lazy.deferred
    assert w.cpu().tolist() == [1.0, 3.0, 5.0]


def test_switching_to_debug_runs_what_strict_mode_recorded():
    w = torch.arange(3.0).to(TPU)
    torch._foreach_mul_([w], 2.0)
    assert lazy.deferred
    with tpu_train.eager_mode("debug"):
        assert not lazy.deferred
        assert w.cpu().tolist() == [0.0, 2.0, 4.0]


def test_a_foreach_shape_error_is_raised_at_the_op():
    a, b = torch.ones(3, device=TPU), torch.ones(4, device=TPU)
    with pytest.raises(RuntimeError):
        torch._foreach_add_([a], [b])
    assert (a + 0).cpu().tolist() == [1.0, 1.0, 1.0]


def test_a_parameter_copied_before_the_step_keeps_its_old_value():
    model = _model().to(TPU)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    kept = copy.deepcopy(model)
    model(torch.ones(2, 6, device=TPU)).sum().backward()
    opt.step()
    for p, q in zip(model.parameters(), kept.parameters()):
        assert not torch.equal(p.detach().cpu(), q.detach().cpu())
    torch.testing.assert_close(kept[0].weight.detach().cpu(), _model()[0].weight.detach())


def _bf16_gradient():
    torch.manual_seed(1)
    w = torch.randn(64, dtype=torch.bfloat16).to(TPU).requires_grad_()
    x = torch.linspace(-2, 2, 64, dtype=torch.bfloat16).to(TPU)
    # A chain of bf16 elementwise ops: XLA may compute it in float32 and round once.
    loss = ((w * x).tanh() * 3 + w.sigmoid() * x).exp().float().sum()
    loss.backward()
    return w.grad.cpu()


def test_a_recorded_backward_rounds_each_op_like_running_it_alone():
    _bf16_gradient()  # an op's first call runs alone
    before = lazy.stats()
    recorded = _bf16_gradient()
    assert lazy.stats()["ops_recorded"] > before["ops_recorded"]  # the backward was recorded
    with tpu_train.eager_mode("debug"):
        alone = _bf16_gradient()
    assert torch.equal(recorded, alone)
