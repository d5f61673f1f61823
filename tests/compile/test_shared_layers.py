"""Repeated layers traced once and called per layer in the loss graph
(tpu_train.compile.shared_layers).

Sharing a body must not change what the step computes: the program is checked against the
layer-by-layer trace (bit for bit on the CPU client, to float32 rounding on a TPU), and each
case where a layer's call does not fit a shared body (a layer that detaches inside, random ops,
two models with the same shapes but different settings, layers called out of order with their
own arguments) against CPU PyTorch.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.platforms import PLATFORM
from tests.tolerances import loss_rtol, update_rtol
from tpu_train.compile import lower_train_step, shared_layers

from .helpers import (DEVICE, OPTIMIZERS, TINY_LLAMA_FUNCTIONS, assert_losses_close,
                      assert_params_close, assert_params_within, lm_batches, lm_loss, mlp_batches,
                      mlp_loss, param_bound, run_compiled, run_reference, tiny_llama, to_device)

STEPS = 3


class Block(torch.nn.Module):
    def __init__(self, scale: float, detach: bool = False, dropout: float = 0.0):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.scale = scale  # baked into the traced body
        self.detach = detach
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x, gate):
        y = torch.tanh(self.linear(x)) * self.scale
        if self.detach:
            y = y + y.detach() * 0.5
        return x + self.dropout(y) * gate


class Stack(torch.nn.Module):
    """Four interchangeable blocks; ``reverse`` calls them last to first, each with its own
    gate (a call needs nothing of its neighbours, unlike a scan)."""

    def __init__(self, scale: float = 0.5, reverse: bool = False, **block):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(12, 8)
        self.layers = torch.nn.ModuleList(Block(scale, **block) for _ in range(4))
        self.out = torch.nn.Linear(8, 5)
        self.reverse = reverse

    def forward(self, x):
        h = self.inp(x)
        order = list(self.layers)[::-1] if self.reverse else self.layers
        for i, layer in enumerate(order):
            h = layer(h, torch.sigmoid(h.mean(-1, keepdim=True) + i))
        return self.out(h)


SGD = OPTIMIZERS["sgd"]


def _program(model, batch, loss_fn=mlp_loss):
    model = model.to(DEVICE)
    return lower_train_step(model, SGD(model.parameters()), loss_fn, to_device(batch),
                            compile=False)


def _trains_like_cpu(make_model):
    batches = mlp_batches(STEPS)
    expected, reference, _, _ = run_reference(make_model(), SGD, mlp_loss, batches, device="cpu")
    metrics, model, _, _ = run_compiled(make_model(), SGD, mlp_loss, batches)
    # The stack's elementwise functions: each block's tanh and its gate's sigmoid.
    functions = ("tanh", "sigmoid") * 4
    assert_losses_close([m["loss"] for m in metrics], expected,
                        loss_rtol(torch.float32, STEPS, 8, functions=functions))
    assert_params_close(model, reference, update_rtol(torch.float32, STEPS, 8, functions=functions))


def test_a_stack_is_one_body_and_computes_the_layer_by_layer_step_bit_for_bit(monkeypatch):
    batches = lm_batches(STEPS)
    program = _program(tiny_llama(), batches[0], lm_loss)
    assert (program.autodiff, shared_layers.called_layers(program.grad_graph)) == ("jax", 2)

    adamw = OPTIMIZERS["adamw"]
    shared, shared_model, _, _ = run_compiled(tiny_llama(), adamw, lm_loss, batches,
                                              max_grad_norm=1.0)
    monkeypatch.setattr(shared_layers, "traced_with_shared_layers",
                        lambda model, trace, wrap_body=None: trace())
    assert shared_layers.called_layers(_program(tiny_llama(), batches[0], lm_loss).grad_graph) == 0
    inline, inline_model, _, _ = run_compiled(tiny_llama(), adamw, lm_loss, batches,
                                              max_grad_norm=1.0)
    if PLATFORM == "cpu":
        assert [m["loss"] for m in shared] == [m["loss"] for m in inline]
        for p, q in zip(shared_model.parameters(), inline_model.parameters()):
            assert torch.equal(p.detach().cpu(), q.detach().cpu())
        return
    # JAX differentiates a layer call as a call, so the two programs XLA gets are the same
    # arithmetic but not the same graph; XLA's TPU compiler fuses them differently (compiled
    # for a v5e, shared against inline: 59 and 57 dots, 13 and 23 exponentials), and their
    # sums round differently: on a v5e the losses and gradient norms were equal, the
    # parameters after 3 steps up to 4.9e-7 apart. The bounds are float32 rounding over the
    # tiny Llama's chained reductions (tests/tolerances.py); a layer given another's weights
    # or inputs moves its parameters by about the learning rate, far outside them.
    reduction, depth = 128, 2 * (6 * 2 + 2)
    for m, ref in zip(shared, inline):
        assert m["loss"] == pytest.approx(ref["loss"], rel=loss_rtol(
            torch.float32, STEPS, reduction, functions=TINY_LLAMA_FUNCTIONS))
    assert_params_within(shared_model, inline_model, param_bound(
        "adamw", tiny_llama(), STEPS, reduction, depth=depth,
        functions=2 * TINY_LLAMA_FUNCTIONS))


def test_layers_called_out_of_order_with_their_own_arguments_share_a_body():
    assert shared_layers.called_layers(_program(Stack(reverse=True), mlp_batches(1)[0])
                                       .grad_graph) == 4
    _trains_like_cpu(lambda: Stack(reverse=True))


def test_models_with_the_same_shapes_but_other_settings_get_their_own_bodies():
    """The second stack's blocks scale by 1.5, the first's by 0.5 (an attribute, not a
    tensor): compiled one after the other in one process, each must train like itself."""
    _trains_like_cpu(lambda: Stack(scale=0.5))
    _trains_like_cpu(lambda: Stack(scale=1.5))


class DetachesBetweenLayers(Stack):
    """A ``detach()`` of a layer call's output: the call's outputs must answer
    ``requires_grad`` as the layer's own would, or the probe would not see it."""

    def forward(self, x):
        h = self.inp(x)
        for i, layer in enumerate(self.layers):
            h = layer(h, torch.sigmoid(h.mean(-1, keepdim=True) + i))
            if i == 1:
                h = h.detach() * 0.5 + h
        return self.out(h)


@pytest.mark.parametrize("make_model", [lambda: Stack(detach=True), DetachesBetweenLayers],
                         ids=["inside_a_layer", "between_layers"])
def test_a_detach_makes_the_step_trace_pytorchs_backward(make_model):
    program = _program(make_model(), mlp_batches(1)[0])
    assert program.autodiff == "torch"
    assert program.autodiff_note.startswith("the forward uses autograd itself: "
                                            "TorchAutogradNeeded: detach()"), \
        program.autodiff_note
    _trains_like_cpu(make_model)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_layers_drawing_random_numbers_are_traced_inline(training):
    """Dropout in training: each layer must draw its own mask, so no body is shared (in eval
    mode dropout is the identity and the stack is shared again)."""
    model = Stack(dropout=0.5).train(training)
    program = _program(model, mlp_batches(1)[0])
    assert program.autodiff == "jax"
    assert shared_layers.called_layers(program.grad_graph) == (0 if training else 4)
