"""``trainer.remat``: what each decoder layer keeps for its backward.

In the compiled step (layer by layer and scanned) a policy must change what the program keeps:
XLA's own buffer assignment of the compiled program (CPU client) shows less temporary memory
the less a policy keeps, and its FLOPs show the recomputation. Gradients are those of PyTorch's
autograd on the CPU without recomputation, in the compiled step and eagerly.

A ``full`` layer is PyTorch's recomputed region, with PyTorch's backward traced, on the CPU
client only; for a TPU it is a ``jax.checkpoint`` layer call differentiated by JAX
(tpu_train.compile.shared_layers, ``_trace_body``; docs/compile.md, "Remat policies").
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpu_train.compile import lower_train_step
from tpu_train.models import LLAMA
from tpu_train.parallel.activation_checkpointing import (apply_activation_checkpointing,
                                                         remat_setting)

from tests.platforms import PLATFORM
from tests.tolerances import assert_rel_close, update_rtol

from .helpers import DEVICE, TINY_LLAMA_FUNCTIONS, lm_batches, lm_loss, tiny_llama, to_device
from tests.markers import needs_libtpu

F32 = torch.float32
POLICIES = ("none", "save_dots", "save_qkv_proj", "full")
# Longest reduction of a gradient: the SwiGLU weights' (176) over 2 x 32 tokens.
REDUCTION = 176 * 64
# One gradient against the CPU's: forward and backward, with the tiny Llama's and its
# cross-entropy's elementwise functions along both.
GRAD_RTOL = update_rtol(F32, 1, REDUCTION, depth=2, functions=2 * TINY_LLAMA_FUNCTIONS)
LR = 2.0 ** 30
# Is a ``full`` layer traced layer by layer PyTorch's recomputation (the CPU client), or a
# layer call JAX differentiates (a TPU)? (shared_layers: fenced recomputation on the CPU client)
FULL_IS_PYTORCHS = PLATFORM == "cpu"


@functools.lru_cache(maxsize=None)
def _compiled_figures(scan: bool) -> dict:
    """XLA's temporary bytes and FLOPs of the step of a 3-layer Llama (dim 256, 8 x 128
    tokens: activations dominate), per policy."""
    from tpu_train.models import CONFIGS, Llama

    config = dataclasses.replace(CONFIGS["debug_tiny"], n_layers=3)
    figures = {}
    for remat in POLICIES:
        with torch.device("meta"):
            model = Llama(config)
            tokens = torch.empty(8, 128, dtype=torch.int64)
        apply_activation_checkpointing(model, remat, qkv_projections=LLAMA.qkv_projections)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        program = lower_train_step(model, optimizer, lm_loss,
                                   {"tokens": tokens, "labels": tokens.clone()},
                                   scan_layers=scan)
        analysis = program.analysis()
        figures[remat] = (analysis["temp_size_in_bytes"], analysis["flops_per_device"])
    return figures


def test_policies_keep_less_layer_by_layer():
    # Measured on the CPU client: 101, 58, 44, 40 MB; 16.7, 17.1, 19.9, 20.7 GFLOP.
    temp = {remat: t for remat, (t, _) in _compiled_figures(False).items()}
    flops = {remat: f for remat, (_, f) in _compiled_figures(False).items()}
    # Recomputation is work: the forward's elementwise ops (save_dots), all but the q/k/v
    # projections (save_qkv_proj), the whole forward (full). Compiled for a v5e: 16.8, 17.3,
    # 20.1, 20.9 GFLOP.
    assert flops["none"] < flops["save_dots"] < flops["save_qkv_proj"] < flops["full"], flops
    if PLATFORM != "cpu":
        # XLA's TPU compiler schedules the temporaries itself, so what a policy keeps is not
        # an order of its temporaries there (docs/compile.md, "Remat policies": for the 1B
        # step at 2 and 4 layers full's exceed save_qkv_proj's). This step compiled for a
        # v5e: 9.58, 9.97, 9.84, 9.84 MB at XLA's default optimization effort; 57.6, 45.2,
        # 36.5, 30.8 MB at the least effort the TPU lane compiles with.
        return
    assert temp["none"] > temp["save_dots"] > temp["save_qkv_proj"] > temp["full"], temp
    assert temp["full"] < 0.5 * temp["none"], temp


def test_policies_keep_less_in_a_scanned_stack():
    # A scanned layer keeps its projections' outputs by itself: none is save_dots there.
    # Measured: 80, 80, 69, 63 MB.
    temp = {remat: t for remat, (t, _) in _compiled_figures(True).items()}
    assert temp["none"] == temp["save_dots"] > temp["save_qkv_proj"] > temp["full"], temp


def _cpu_gradients(model, batch) -> dict:
    model = copy.deepcopy(model)
    lm_loss(model, batch).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("remat", POLICIES)
def test_compiled_gradients_match_autograd(remat, scan):
    model, batch = tiny_llama(), lm_batches(1)[0]
    expected = _cpu_gradients(model, batch)
    trained = copy.deepcopy(model)
    apply_activation_checkpointing(trained, remat, qkv_projections=LLAMA.qkv_projections)
    trained.to(DEVICE)
    before = {name: p.detach().cpu().clone() for name, p in trained.named_parameters()}
    # One SGD step at a learning rate that moves each parameter by far more than its size,
    # so that before - after (divided by it) is its gradient to float32's rounding.
    from tpu_train.compile import compile_train_step

    step = compile_train_step(trained, torch.optim.SGD(trained.parameters(), lr=LR), lm_loss,
                              scan_layers=scan)
    step(to_device(batch))
    (program,) = step.cache.entries.values()
    # Scanned stacks, and full recomputation layer by layer on the CPU client: PyTorch's
    # backward is traced.
    assert program.autodiff == ("torch" if scan or (remat == "full" and FULL_IS_PYTORCHS)
                                else "jax"), program.autodiff_note
    for name, p in trained.named_parameters():
        assert_rel_close((before[name] - p.detach().cpu()) / LR, expected[name],
                         GRAD_RTOL, f"{remat} {name}")


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["cpu", DEVICE])
def test_eager_policies(device):
    """Eagerly, ``full`` and ``save_qkv_proj`` recompute each layer, ``save_dots`` all but
    its projections (PyTorch's selective checkpointing); gradients unchanged."""
    model, batch = tiny_llama(), lm_batches(1)[0]
    expected = _cpu_gradients(model, batch)
    matmuls = {}
    for remat in POLICIES:
        checkpointed = copy.deepcopy(model)
        wrapped = apply_activation_checkpointing(checkpointed, remat,
                                                 qkv_projections=LLAMA.qkv_projections)
        assert wrapped == (0 if remat == "none" else 2)
        checkpointed.to(device)
        loss = lm_loss(checkpointed, {k: v.to(device) for k, v in batch.items()})
        with _CountMatmuls() as counter:
            loss.backward()
        matmuls[remat] = counter.count
        for name, p in checkpointed.named_parameters():
            assert_rel_close(p.grad.cpu(), expected[name], GRAD_RTOL, f"{remat} {name}")
    # 6 of a layer's 7 projections: PyTorch stops recomputing once it has what backward reads
    # (the down projection's output is only added to the residual).
    assert matmuls["full"] == matmuls["save_qkv_proj"] == matmuls["none"] + 2 * 6, matmuls
    assert matmuls["save_dots"] == matmuls["none"], matmuls


def test_bad_policy_is_one_line():
    with pytest.raises(ValueError, match=r"^trainer.remat='some' is not a remat policy; "
                                         r"choose one of none, full, save_dots, save_qkv_proj, "
                                         r"offload$"):
        remat_setting("some")
    with pytest.raises(ValueError, match="trainer.activation_checkpointing=true means "
                                         "trainer.remat=full, but trainer.remat=save_dots"):
        remat_setting("save_dots", activation_checkpointing=True)
    assert remat_setting("none", activation_checkpointing=True) == "full"


def test_save_qkv_proj_needs_projections():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])

    with pytest.raises(ValueError, match="layer 0 of Model has no q: choose "
                                         "trainer.remat=save_dots"):
        apply_activation_checkpointing(Model(), "save_qkv_proj", qkv_projections=("q", "k", "v"))
    with pytest.raises(ValueError, match="which its model family does not name: choose "
                                         "trainer.remat=save_dots"):
        apply_activation_checkpointing(Model(), "save_qkv_proj")


@needs_libtpu
def test_for_a_tpu_full_is_a_recomputed_layer_call():
    """For a TPU (compiled without a chip, and on a chip's own platform) a ``full`` layer is a
    body differentiated by JAX through ``jax.checkpoint``; on the CPU client it is PyTorch's
    recomputed region."""
    from tpu_train.compile.layer_scan import body
    from tpu_train.compile.shared_layers import LAYER_CALL
    from tpu_train.models import Llama

    tiny = tiny_llama()
    with torch.device("meta"):
        model = Llama(tiny.config)
        tokens = torch.empty(2, 32, dtype=torch.int64)
    apply_activation_checkpointing(model, "full")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"tokens": tokens, "labels": tokens.clone()}
    here = "torch" if FULL_IS_PYTORCHS else "jax"  # target None: this process's platform
    for target, autodiff in (("v5e", "jax"), (None, here)):
        program = lower_train_step(model, optimizer, lm_loss, batch, scan_layers=False,
                                   target=target, compile=False)
        assert program.autodiff == autodiff, (target, program.autodiff_note)
        calls = [n for n in program.grad_graph.graph.nodes if n.target is LAYER_CALL]
        assert [body(n.args[0]).remat for n in calls] == (["full"] * 2 if autodiff == "jax"
                                                          else [])
