"""JAX differentiates the traced forward where that forward carries all of autograd's behaviour,
and PyTorch's traced backward is used where it does not (tpu_train.compile.loss_graph).

Each fallback case cuts or changes a gradient the way only autograd knows (detach, ``.data``,
``no_grad``, a tensor hook, a forward that writes a buffer): differentiated through the forward
graph by JAX, its gradients would be wrong, so each case is checked against CPU PyTorch, and the
path it took is asserted. The models that do take the JAX path are checked against the traced
PyTorch backward of the same step.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.tolerances import loss_rtol, update_rtol
from tpu_train.compile import compile_train_step, lower_train_step

from .helpers import (DEVICE, OPTIMIZERS, assert_losses_close, assert_params_close,
                      assert_params_within, lm_batches, lm_loss, param_bound, run_compiled,
                      run_reference, tiny_llama, to_device)

STEPS = 3


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


class _Base(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, 8)
        self.second = torch.nn.Linear(8, 8)
        self.third = torch.nn.Linear(8, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))


class Detaches(_Base):
    def forward(self, x):
        y = torch.tanh(self.first(x))
        return self.third(self.second(y.detach()) + y)


class ReadsData(_Base):
    def forward(self, x):
        y = torch.tanh(self.first(x))
        return self.third(self.second(y) * y.data)


class NoGradOnActivations(_Base):
    def forward(self, x):
        y = torch.tanh(self.first(x))
        with torch.no_grad():
            norm = y.abs().mean() + 1.0
        return self.third(self.second(y) / norm)


class TensorHook(_Base):
    def forward(self, x):
        y = torch.tanh(self.first(x))
        y.register_hook(lambda grad: grad * 3.0)
        return self.third(self.second(y))


class BatchNormed(_Base):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return self.third(self.norm(self.second(torch.tanh(self.first(x)))))


class NoGradOnBuffersOnly(_Base):
    """``no_grad`` around values that do not depend on the parameters (transformers' rotary
    embedding does this) changes no gradient: the JAX path stays."""

    def forward(self, x):
        with torch.no_grad():
            scale = self.scale * 2.0
        return self.third(self.second(torch.tanh(self.first(x))) * scale)


class AtTheEdges(torch.nn.Module):
    """Values where a derivative is a choice: relu at 0, hardtanh and clamp at their bounds, the
    norm of a zero row, a max-pool window of equal values. JAX differentiates the loss graph
    here; each lowering must give PyTorch's choice (relu'(0) = 0, not maximum's 1/2; a zero
    vector's norm gradient 0, not NaN; the first maximum of a window gets the gradient)."""

    def __init__(self):
        super().__init__()
        row = [0.0, 1.0, -1.0, 0.5, -0.5, 2.0, 0.25, 0.25]
        self.p = torch.nn.Parameter(torch.tensor([row, row]))

    def forward(self, x):
        p = self.p
        rows = torch.stack([p[0] * 0.0, p[1]])  # a zero row to normalize
        pooled = F.max_pool1d(p.unsqueeze(0), 2)
        parts = [F.relu(p), F.hardtanh(p), torch.clamp(p, -0.5, 0.5),
                 F.normalize(rows, dim=1), pooled.squeeze(0).repeat(1, 2)]
        return sum(part * x[i] for i, part in enumerate(parts))


class NotDifferentiableByJax(_Base):
    """``polygamma`` lowers through a ``while_loop``, which JAX cannot differentiate in reverse
    mode: found when the program is lowered, the step falls back to PyTorch's backward."""

    def forward(self, x):
        y = torch.sigmoid(self.first(x)) + 1.0
        return self.third(self.second(torch.special.polygamma(1, y)))


def _loss(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


def _batches():
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(5, 6, generator=g), "y": torch.randn(5, 3, generator=g)}
            for _ in range(STEPS)]


CASES = {Detaches: "torch", ReadsData: "torch", NoGradOnActivations: "torch",
         TensorHook: "torch", BatchNormed: "torch", NoGradOnBuffersOnly: "jax",
         NotDifferentiableByJax: "torch"}


def _path(model, loss_fn, batch, **kwargs):
    device_model = model.to(DEVICE) if next(model.parameters()).device != DEVICE else model
    program = lower_train_step(device_model, _sgd(device_model.parameters()), loss_fn,
                               to_device(batch), compile=False, **kwargs)
    return program.autodiff, program.autodiff_note


@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_autograd_only_features_take_the_traced_backward_and_train_like_cpu(cls):
    batches = _batches()
    autodiff, note = _path(cls(), _loss, batches[0])
    assert autodiff == CASES[cls], note
    assert (note == "") == (autodiff == "jax")
    if cls is NotDifferentiableByJax:
        assert note.startswith("JAX could not differentiate the loss graph"), note
    elif autodiff == "torch":
        assert note.startswith("the forward uses autograd itself: "), note
    expected, reference, _, _ = run_reference(cls(), _sgd, _loss, batches, device="cpu")
    metrics, model, _, _ = run_compiled(cls(), _sgd, _loss, batches)
    # The models' elementwise functions: tanh, and BatchNormed's rsqrt.
    functions = ("tanh", "rsqrt")
    rtol = loss_rtol(torch.float32, STEPS, 8, functions=functions)
    assert_losses_close([m["loss"] for m in metrics], expected, rtol)
    assert_params_close(model, reference, update_rtol(torch.float32, STEPS, 8, functions=functions))


def test_derivatives_at_ties_and_zeros_are_pytorchs():
    g = torch.Generator().manual_seed(5)
    batches = [{"x": torch.randn(5, 2, 8, generator=g), "y": torch.zeros(2, 8)}]

    def loss(model, batch):
        return (model(batch["x"]) - batch["y"]).square().sum() * 0.5 + model(batch["x"]).sum()

    assert _path(AtTheEdges(), loss, batches[0]) == ("jax", "")
    expected, reference, _, _ = run_reference(AtTheEdges(), _sgd, loss, batches, device="cpu")
    metrics, model, _, _ = run_compiled(AtTheEdges(), _sgd, loss, batches)
    assert torch.isfinite(model.p.detach().cpu()).all()
    assert_losses_close([m["loss"] for m in metrics], expected, 1e-6)
    assert_params_close(model, reference, 1e-6)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_jax_and_torch_autodiff_compute_the_same_steps(autocast):
    batches = lm_batches(STEPS)
    assert _path(tiny_llama(), lm_loss, batches[0]) == ("jax", "")
    assert _path(tiny_llama(), lm_loss, batches[0], autodiff="torch")[0] == "torch"

    adamw = OPTIMIZERS["adamw"]
    jax_metrics, jax_model, _, _ = run_compiled(tiny_llama(), adamw, lm_loss, batches,
                                                max_grad_norm=1.0, autocast_dtype=autocast)
    torch_metrics, torch_model, _, _ = run_compiled(tiny_llama(), adamw, lm_loss, batches,
                                                    max_grad_norm=1.0, autodiff="torch",
                                                    autocast_dtype=autocast)
    # The same lowerings on the same values; only the order XLA sums the backward in differs
    # (under autocast, the bf16 backward products round alike on both paths).
    dtype = autocast or torch.float32
    rtol = loss_rtol(dtype, STEPS, 128) if autocast is None else loss_rtol(dtype, STEPS, 1, 2)
    for key in ("loss", "grad_norm"):
        assert_losses_close([m[key] for m in jax_metrics], [m[key] for m in torch_metrics], rtol)
    bound = param_bound("adamw", tiny_llama(), STEPS, 128 if autocast is None else 1, dtype)
    assert_params_within(jax_model, torch_model, bound)


def test_an_unknown_autodiff_is_a_one_line_error():
    model = torch.nn.Linear(2, 2).to(DEVICE)
    with pytest.raises(ValueError, match=r"autodiff must be one of 'jax', 'torch', got 'tf'"):
        compile_train_step(model, _sgd(model.parameters()), _loss, autodiff="tf")


def test_a_fallback_is_said_in_the_compile_log_line():
    from tpu_train.trainer.summary import describe_compilation

    model = Detaches().to(DEVICE)
    step = compile_train_step(model, _sgd(model.parameters()), _loss)
    step(to_device(_batches()[0]))
    (record,) = step.compilations
    assert record.autodiff_fallback.startswith("TorchAutogradNeeded: detach()"), record
    assert "; PyTorch's backward traced (TorchAutogradNeeded: detach()" in \
        describe_compilation(record)
    plain = NoGradOnBuffersOnly().to(DEVICE)
    step = compile_train_step(plain, _sgd(plain.parameters()), _loss)
    step(to_device(_batches()[0]))
    assert step.compilations[0].autodiff_fallback == ""
