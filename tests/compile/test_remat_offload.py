"""``trainer.remat=offload``: each scanned layer's input kept in host memory for its backward.

The step computes what ``full`` computes (the same recomputation from the same saved values;
only where those values wait differs), and the program compiled for a TPU holds the stacked
layer inputs in host memory where ``full`` keeps them on the chip. Settings that cannot offload
are one-line errors.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from tpu_train.compile import compile_train_step, lower_train_step, remat_regions
from tpu_train.models import LLAMA
from tpu_train.parallel.activation_checkpointing import apply_activation_checkpointing

from tests.tolerances import assert_rel_close

from .helpers import DEVICE, lm_batches, lm_loss, tiny_llama, to_device
from tests.markers import needs_libtpu

STEPS = 3


@functools.lru_cache(maxsize=None)
def _trained(remat: str) -> tuple:
    """Losses and final weights of ``STEPS`` AdamW steps of the tiny Llama, its layers scanned
    and checkpointed with ``remat``, and the step's optimized program text."""
    model = tiny_llama()
    apply_activation_checkpointing(model, remat, qkv_projections=LLAMA.qkv_projections)
    model.to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = compile_train_step(model, optimizer, lm_loss, scan_layers=True)
    losses = [float(step(to_device(batch))["loss"]) for batch in lm_batches(STEPS)]
    (program,) = step.cache.entries.values()
    weights = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    return losses, weights, program.executable.as_text()


def test_offload_trains_as_full():
    full_losses, full_weights, _ = _trained("full")
    losses, weights, _ = _trained("offload")
    # The same values recomputed from the same saved inputs: equal to float32 rounding of
    # XLA's fusion choices, not to a tolerance of the recomputation.
    assert losses == pytest.approx(full_losses, rel=1e-5, abs=0), (losses, full_losses)
    for name, value in weights.items():
        assert_rel_close(value, full_weights[name], 1e-5, name)


@needs_libtpu
def test_for_a_tpu_layer_inputs_are_in_host_memory():
    """Compiled for a v5e (no chip): the stacked layer inputs live in host memory (XLA's
    memory space 5, ``S(5)`` in a shape's layout) where ``full`` keeps them on the chip. The
    CPU client has no transfer to make: there the policy only changes where JAX says the
    value lives."""
    from tpu_train.models import Llama

    texts, config = {}, tiny_llama().config
    for remat in ("full", "offload"):
        with torch.device("meta"):
            model = Llama(config)
            tokens = torch.empty(2, 32, dtype=torch.int64)
        apply_activation_checkpointing(model, remat)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        program = lower_train_step(model, optimizer, lm_loss,
                                   {"tokens": tokens, "labels": tokens.clone()},
                                   scan_layers=True, target="v5e")
        texts[remat] = program.executable.as_text()
    # The tiny Llama's layer input (2 x 32 tokens, dim 64) stacked over its 2 layers.
    stacked_on_host = re.compile(r"\[2,2,32,64\]\{[^}]*S\(5\)\}")
    assert stacked_on_host.search(texts["offload"]), "no stacked layer input in host memory"
    assert "S(5)" not in texts["full"]


def test_the_backward_scan_takes_the_last_layers_cotangent_alone():
    """The step reads a stack's stacked output only at its last layer, so PyTorch's gradient of
    it is zeros but for that layer's slice: the backward scan gets that slice, not ``N`` layers
    of zeros (``layer_scan.pass_last_layer_cotangents``; gradients: test_remat.py's scanned
    cases against autograd)."""
    from tpu_train.compile.layer_scan import LAYER_SCAN_BACKWARD, body

    model = tiny_llama()
    apply_activation_checkpointing(model, "full")
    model.to(DEVICE)
    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), lm_loss,
                              scan_layers=True)
    step(to_device(lm_batches(1)[0]))
    (program,) = step.cache.entries.values()
    (backward,) = [n for n in program.grad_graph.graph.nodes if n.target is LAYER_SCAN_BACKWARD]
    b = body(backward.args[0])
    (cotangent,) = backward.args[1][-b.n_outputs:]
    assert tuple(cotangent.meta["val"].shape) == b.output_metas[0].shape == (2, 32, 64)
    assert cotangent.target is not torch.ops.aten.select_scatter.default


def test_offload_of_unscanned_layers_is_one_line():
    model = tiny_llama()
    apply_activation_checkpointing(model, "offload", qkv_projections=LLAMA.qkv_projections)
    model.to(DEVICE)
    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), lm_loss,
                              scan_layers=False)
    with pytest.raises(remat_regions.UnsupportedCheckpointError,
                       match=r"^trainer.remat=offload moves the inputs of scanned layers to "
                             r"host memory, .* set trainer.scan_layers=true"):
        step(to_device(lm_batches(1)[0]))


def test_devices_without_host_memory_are_one_line():
    class Memory:
        kind = "device"

    class Device:
        platform, id = "tpu", 3

        def addressable_memories(self):
            return [Memory()]

    assert remat_regions.host_offload_problem([]) is None
    import jax

    assert remat_regions.host_offload_problem(jax.devices()) is None
    assert remat_regions.host_offload_problem([Device()]) == (
        "trainer.remat=offload moves each layer's input to host memory, which tpu device 3 "
        "does not address (pinned_host is not among its memory kinds ['device']); use "
        "trainer.remat=full")
