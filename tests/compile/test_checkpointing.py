"""``torch.utils.checkpoint`` inside compiled steps: recomputed in the program, same numbers.

The memory figures come from XLA's own buffer assignment of the compiled program
(``memory_analysis().temp_size_in_bytes``: everything the step allocates besides its inputs
and outputs; on a TPU, in HBM), so they are exact for the platform the tests run on.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tpu_train.compile import compile_train_step, layer_scan, shared_layers
from tpu_train.compile.remat_regions import OPTIMIZATION_BARRIER, UnsupportedCheckpointError

from tests.platforms import PLATFORM
from tests.tolerances import loss_rtol

from .helpers import (DEVICE, OPTIMIZERS, TINY_LLAMA_FUNCTIONS, assert_losses_close,
                      assert_params_within, lm_batches, lm_loss, param_bound, run_compiled,
                      tiny_llama)

# Float32 tolerances (tests/tolerances.py). The stack: 3 AdamW steps; its longest reduction is
# the mean-squared error over 1024 x 128 outputs (the matmuls reduce over 128, 1024 and the
# batch of 1024). The tiny Llama: 4 AdamW steps, clipped; its longest reduction is the clip
# norm's squared sum over the largest tensor, the SwiGLU weight 176 x 64.
F32 = torch.float32
STACK_STEPS, STACK_N = 3, 1024 * 128
LLAMA_STEPS, LLAMA_N = 4, 176 * 64
# The stack's elementwise functions: each of its 6 blocks' tanh and sigmoid.
STACK_FUNCTIONS = ("tanh", "sigmoid") * 6
# The blocks' hidden width. XLA's TPU compiler keeps buffers that fit in the chip's on-chip
# memory there, and memory_analysis counts HBM only: 1024-wide blocks' activations (6 x 4 MiB)
# never reach HBM, checkpointed or not (compiled for a v5e: 6.7 MB plain, 7.5 MB checkpointed);
# 8192-wide ones do (145.8 MB plain, 20.7 MB checkpointed). The longest reduction stays STACK_N.
STACK_HIDDEN = 1024 if PLATFORM == "cpu" else 8192


class _WideBlock(torch.nn.Module):
    """Residual block whose hidden activations (1024 rows x STACK_HIDDEN floats) dwarf its
    input (0.5 MiB): what activation checkpointing is for."""

    def __init__(self, dim=128, hidden=STACK_HIDDEN):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.up(x)
        return x + self.down(torch.tanh(h) * torch.sigmoid(h))


class _Stack(torch.nn.Module):
    def __init__(self, mode=None, layers=6):
        super().__init__()
        self.mode = mode  # None, "non_reentrant", "reentrant" or "closure"
        self.layers = torch.nn.ModuleList(_WideBlock() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            if self.mode == "non_reentrant":
                x = checkpoint(layer, x, use_reentrant=False)
            elif self.mode == "reentrant":
                x = checkpoint(layer.forward, x, use_reentrant=True)
            elif self.mode == "closure":  # a function owned by no module
                x = checkpoint(lambda v, layer=layer: layer(v), x, use_reentrant=False)
            else:
                x = layer(x)
        return x


def _stack_loss(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


def _stack_batches(n):
    g = torch.Generator().manual_seed(2)
    return [{"x": torch.randn(1024, 128, generator=g), "y": torch.randn(1024, 128, generator=g)}
            for _ in range(n)]


def _train_stack(mode, batches):
    torch.manual_seed(0)
    model = _Stack(mode)
    metrics, trained, _, step = run_compiled(model, OPTIMIZERS["adamw"], _stack_loss, batches)
    (program,) = step.cache.entries.values()
    return [m["loss"] for m in metrics], trained, program


@pytest.fixture(scope="module")
def plain_stack():
    return _train_stack(None, _stack_batches(STACK_STEPS))


def test_checkpointed_regions_are_recomputed_with_less_memory(plain_stack):
    losses, model, program = plain_stack
    ck_losses, ck_model, ck_program = _train_stack("non_reentrant", _stack_batches(STACK_STEPS))
    # The same arithmetic in another order: equal up to float32 rounding.
    assert_losses_close(ck_losses, losses,
                        loss_rtol(F32, STACK_STEPS, STACK_N, functions=STACK_FUNCTIONS))
    assert_params_within(ck_model, model, param_bound("adamw", model, STACK_STEPS, STACK_N,
                                                      functions=STACK_FUNCTIONS))
    barriers = [n for n in ck_program.grad_graph.graph.nodes if n.target is OPTIMIZATION_BARRIER]
    assert len(barriers) == 6  # one recomputed region per block
    plain = program.executable.memory_analysis().temp_size_in_bytes
    checkpointed = ck_program.executable.memory_analysis().temp_size_in_bytes
    # Measured on the CPU client: 83.9 MB without checkpointing, 24.6 MB with it (six blocks'
    # hidden activations stored vs one block's recomputed at a time); for a TPU see STACK_HIDDEN.
    assert checkpointed < 0.5 * plain, (checkpointed, plain)


@pytest.mark.parametrize("mode", ["reentrant", "closure"])
def test_other_checkpoint_forms_train_the_same(plain_stack, mode):
    losses, model, _ = plain_stack
    ck_losses, ck_model, ck_program = _train_stack(mode, _stack_batches(STACK_STEPS))
    assert_losses_close(ck_losses, losses,
                        loss_rtol(F32, STACK_STEPS, STACK_N, functions=STACK_FUNCTIONS))
    assert_params_within(ck_model, model, param_bound("adamw", model, STACK_STEPS, STACK_N,
                                                      functions=STACK_FUNCTIONS))
    assert any(n.target is OPTIMIZATION_BARRIER for n in ck_program.grad_graph.graph.nodes)


def test_trainer_activation_checkpointing_on_llama():
    from tpu_train.parallel.activation_checkpointing import apply_activation_checkpointing

    model, batches = tiny_llama(), lm_batches(LLAMA_STEPS)
    # Layer by layer (scan_layers=False): each layer is a recomputed region of its own.
    # Scanned layers are recomputed inside the loop instead (tests/compile/test_scan_layers.py).
    metrics, trained, _, _ = run_compiled(model, OPTIMIZERS["adamw"], lm_loss, batches,
                                          max_grad_norm=1.0, scan_layers=False)
    checkpointed = copy.deepcopy(model)
    assert apply_activation_checkpointing(checkpointed) == 2
    ck_metrics, ck_trained, _, step = run_compiled(checkpointed, OPTIMIZERS["adamw"], lm_loss,
                                                   batches, max_grad_norm=1.0, scan_layers=False)
    assert_losses_close([m["loss"] for m in ck_metrics], [m["loss"] for m in metrics],
                        loss_rtol(F32, LLAMA_STEPS, LLAMA_N, functions=TINY_LLAMA_FUNCTIONS))
    assert_params_within(ck_trained, trained, param_bound("adamw", model, LLAMA_STEPS, LLAMA_N,
                                                          functions=TINY_LLAMA_FUNCTIONS))
    (program,) = step.cache.entries.values()
    nodes = program.grad_graph.graph.nodes
    if PLATFORM == "cpu":
        # PyTorch's backward and its recomputation, each region's inputs fenced (XLA's CPU
        # pipeline would merge an unfenced recomputation with the forward).
        assert program.autodiff == "torch"
        assert sum(n.target is OPTIMIZATION_BARRIER for n in nodes) == 2
    else:
        # For a TPU the JAX form (tpu_train/compile/shared_layers.py): JAX differentiates
        # the loss graph, whose two layer calls recompute everything (jax.checkpoint, full).
        assert program.autodiff == "jax"
        calls = [n for n in nodes if n.target is shared_layers.LAYER_CALL]
        assert [layer_scan.body(n.args[0]).remat for n in calls] == ["full", "full"]
    # Eager execution (outside the compiled step) still uses torch's own checkpoint.
    tokens = batches[0]["tokens"].to(DEVICE)
    out = ck_trained(tokens)
    out.float().mean().backward()
    assert ck_trained.output.weight.grad is not None


def test_random_ops_in_a_checkpointed_region_are_rejected():
    class Dropped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return checkpoint(lambda v: F.dropout(self.lin(v), 0.5), x, use_reentrant=False)

    model = Dropped().to(DEVICE)
    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              lambda m, b: m(b).pow(2).mean())
    with pytest.raises(UnsupportedCheckpointError, match="random op"):
        step(torch.randn(4, 8).to(DEVICE))
