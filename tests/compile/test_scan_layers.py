"""Repeated layers scanned (``compile_train_step(..., scan_layers=True)``; by default for
stacks of 20 layers or more).

A stack of identical decoder layers is traced once and run as a ``lax.scan``: the same losses
and parameters as the unrolled program (``scan_layers=False``), with one layer's ops in the
graph. Where the model does not call its layers as such a stack, or a layer cannot be scanned,
the step falls back to tracing layer by layer — and still computes what the model computes.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tpu_train.compile import layer_groups
from tpu_train.compile.remat_regions import OPTIMIZATION_BARRIER
from tpu_train.compile.layer_scan import LAYER_SCAN, LAYER_SCAN_BACKWARD, body

from tests.tolerances import loss_rtol

from .helpers import (OPTIMIZERS, _llama, assert_losses_close, assert_params_within,
                      lm_batches, lm_functions, lm_loss, param_bound, run_compiled)

F32 = torch.float32
STEPS = 4
# Longest reduction: the clip norm's squared sum over the SwiGLU weight (176 x 64).
REDUCTION = 176 * 64
LAYERS = 3
FUNCTIONS = lm_functions(LAYERS)  # its layers' and its cross-entropy's elementwise functions


def _model():
    return _llama(dim=64, n_layers=LAYERS, n_heads=4, n_kv_heads=2, vocab_size=128,
                  ffn_hidden_dim=176, max_seq_len=32)


def _scans(step) -> list[torch.fx.Node]:
    (program,) = step.cache.entries.values()
    return [n for n in program.grad_graph.graph.nodes if n.target is LAYER_SCAN]


@functools.lru_cache(maxsize=None)
def _run(scan: bool, checkpointed: bool = False):
    model = _model()
    if checkpointed:
        from tpu_train.parallel.activation_checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    metrics, trained, _, step = run_compiled(model, OPTIMIZERS["adamw"], lm_loss,
                                             lm_batches(STEPS), max_grad_norm=1.0,
                                             scan_layers=scan)
    return [m["loss"] for m in metrics], trained, step


def test_scanned_stack_matches_the_unrolled_program():
    losses, trained, step = _run(True)
    ref_losses, ref_trained, ref_step = _run(False)
    assert_losses_close(losses, ref_losses, loss_rtol(F32, STEPS, REDUCTION, functions=FUNCTIONS))
    assert_params_within(trained, ref_trained,
                         param_bound("adamw", _model(), STEPS, REDUCTION, functions=FUNCTIONS))
    (scan,) = _scans(step)
    assert len(scan.args[1]) == LAYERS * 9 + 3  # 9 tensors per layer; x, cos, sin
    (program,) = step.cache.entries.values()
    backward = [n for n in program.grad_graph.graph.nodes if n.target is LAYER_SCAN_BACKWARD]
    assert len(backward) == 1
    assert _scans(ref_step) == []
    # Both trace one layer's ops: scanned here, a body called per layer unrolled (the
    # forward JAX differentiates, tpu_train.compile.shared_layers).
    assert step.compilations[0].scanned_layers == LAYERS
    assert ref_step.compilations[0].shared_layer_calls == LAYERS
    assert len(step.compilations) == 1


def test_checkpointed_layers_are_recomputed_inside_the_scan():
    losses, trained, step = _run(True, checkpointed=True)
    plain_losses, plain_trained, plain_step = _run(True)
    assert_losses_close(losses, plain_losses,
                        loss_rtol(F32, STEPS, REDUCTION, functions=FUNCTIONS))
    assert_params_within(trained, plain_trained,
                         param_bound("adamw", _model(), STEPS, REDUCTION, functions=FUNCTIONS))
    (scan,) = _scans(step)
    assert body(scan.args[0]).checkpointed
    (program,) = step.cache.entries.values()
    (plain_program,) = plain_step.cache.entries.values()
    assert not any(n.target is OPTIMIZATION_BARRIER for n in program.grad_graph.graph.nodes)
    # Residuals stacked per layer: only each layer's input when it is recomputed.
    checkpointed = program.executable.memory_analysis().temp_size_in_bytes
    stored = plain_program.executable.memory_analysis().temp_size_in_bytes
    assert checkpointed < stored, (checkpointed, stored)


class _Between(torch.nn.Module):
    """Scales the activation between two layers: not a plain stack."""

    def __init__(self, llama):
        super().__init__()
        self.llama = llama

    def forward(self, tokens):
        m = self.llama
        h = m.tok_embeddings(tokens)
        cos, sin = m.rope_cos[:tokens.shape[1]], m.rope_sin[:tokens.shape[1]]
        for i, layer in enumerate(m.layers):
            h = layer(h, cos, sin)
            if i == 0:
                h = h * 0.5
        return m.output(m.norm(h))


class _Skipping(_Between):
    """Calls only the first two of three layers."""

    def forward(self, tokens):
        m = self.llama
        h = m.tok_embeddings(tokens)
        cos, sin = m.rope_cos[:tokens.shape[1]], m.rope_sin[:tokens.shape[1]]
        for layer in list(m.layers)[:2]:
            h = layer(h, cos, sin)
        return m.output(m.norm(h))


def _lm_loss(model, batch):
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


@pytest.mark.parametrize("wrapper", [_Between, _Skipping], ids=["op_between", "skipped_layer"])
def test_a_model_that_is_not_a_plain_stack_is_traced_layer_by_layer(wrapper):
    model = wrapper(_model())
    batches = lm_batches(2)
    metrics, _, _, step = run_compiled(model, OPTIMIZERS["adamw"], _lm_loss, batches,
                                       scan_layers=True)
    ref, _, _, _ = run_compiled(model, OPTIMIZERS["adamw"], _lm_loss, batches,
                                scan_layers=False)
    assert _scans(step) == []
    # Asked to scan, the step traces PyTorch's backward of the whole model; the reference
    # (scan_layers=False) takes JAX's gradients of a forward whose layers share one traced
    # body. The same lowerings on the same values: only the order XLA sums the backward in
    # may differ (as in test_loss_graph's jax / torch autodiff comparison).
    assert_losses_close([m["loss"] for m in metrics], [m["loss"] for m in ref],
                        loss_rtol(torch.float32, len(batches), 128, functions=FUNCTIONS))


def test_default_scans_deep_stacks_only():
    # scan_layers=None: stacks of SCAN_MIN_LAYERS or more (shallow ones compile faster
    # unrolled on the CPU client, docs/compile.md); True: all; False: none.
    assert layer_groups.scans(None, layer_groups.SCAN_MIN_LAYERS)
    assert not layer_groups.scans(None, LAYERS)
    assert layer_groups.scans(True, 2) and not layer_groups.scans(False, 80)
    model = _model()
    assert layer_groups.find_groups(model, layer_groups.min_scanned_layers(None)) == []


def test_only_interchangeable_layers_form_a_group():
    model = _model()
    assert [len(g) for g in layer_groups.find_groups(model)] == [LAYERS]
    other = _model()
    other.layers[1].attention_norm.eps = 1e-3  # an attribute the forward reads
    assert layer_groups.find_groups(other) == []
    other = _model()
    other.layers[2].feed_forward.w1 = other.layers[0].feed_forward.w1  # a shared module
    assert layer_groups.find_groups(other) == []


def test_random_layers_are_not_scanned():
    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            return x + F.dropout(self.lin(x), 0.1)

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Noisy() for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Stack()
    batches = [torch.randn(4, 16) for _ in range(2)]

    def loss(m, batch):
        return m(batch["x"]).pow(2).mean()

    metrics, _, _, step = run_compiled(model, OPTIMIZERS["sgd"], loss,
                                       [{"x": b} for b in batches], scan_layers=True)
    assert _scans(step) == []
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)


def test_transformers_llama_without_kv_cache_is_scanned():
    import transformers

    from .test_transformers_models import _DECODER, REDUCTION as HF_REDUCTION, batches, hf_loss
    from .helpers import run_reference

    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=3, use_cache=False,
                                      **{k: v for k, v in _DECODER.items()
                                         if k != "num_hidden_layers"})
    model = transformers.LlamaForCausalLM(config).train()
    data = batches(masked=True)[:3]
    cpu_losses, _, _, _ = run_reference(model, OPTIMIZERS["adamw"], hf_loss, data, device="cpu")
    metrics, _, _, step = run_compiled(model, OPTIMIZERS["adamw"], hf_loss, data,
                                       scan_layers=True)
    assert_losses_close([m["loss"] for m in metrics], cpu_losses,
                        loss_rtol(F32, len(data), HF_REDUCTION, functions=FUNCTIONS))
    (scan,) = _scans(step)
    assert len(body(scan.args[0]).input_metas) >= 3  # hidden states, mask, cos, sin...


def test_layer_gradients_are_read_at_the_programs_layer_indices():
    """Layer j's gradients leave the backward stack through a dynamic slice at the program's
    j-th layer-index input, not through a slice at the constant j: every layer's update and
    gradient-norm fusions are then one computation, which XLA compiles once per parameter slot
    instead of once per layer (docs/compile.md, "Scanned layers")."""
    import jax
    import jax.numpy as jnp

    from tpu_train.compile.layer_scan import _layer_slice, layer_indices

    _, _, step = _run(True)
    (program,) = step.cache.entries.values()
    assert program.layer_indices == LAYERS

    def read(stacked, *indices):
        with layer_indices(indices):
            return [_layer_slice(stacked, j) for j in range(LAYERS)]

    stacked = jnp.arange(LAYERS * 4.0).reshape(LAYERS, 4)
    indices = [jnp.int32(j) for j in range(LAYERS)]

    def primitives_of(jaxpr):  # nested calls (jax wraps some lax functions in a jit) included
        for eqn in jaxpr.eqns:
            inner = eqn.params.get("jaxpr")
            if inner is None:
                yield eqn.primitive.name
            else:
                yield from primitives_of(getattr(inner, "jaxpr", inner))

    primitives = list(primitives_of(jax.make_jaxpr(read)(stacked, *indices).jaxpr))
    assert "slice" not in primitives and primitives.count("dynamic_slice") == LAYERS, primitives
    assert [list(map(float, row)) for row in read(stacked, *indices)] == \
        [list(map(float, row)) for row in stacked]


def test_a_partitioned_bf16_stack_whose_attention_could_take_the_kernels():
    """A scanned layer's residuals are found while the step is traced and again when it is
    lowered. A partitioned program lowers attention in its XLA form (XLA's SPMD partitioner
    does not split a Pallas kernel); traced outside that form, a bf16 layer at a length the
    kernels take kept other residuals, and lowering failed with "a scanned layer's residuals
    changed between two traces" (``tpu-train plan`` of Llama-3.1-8B at 2048 tokens and more).
    The kernels' length threshold is lowered to 128 tokens here, in Pallas' interpret mode:
    the same rule without libtpu and at a tiny size."""
    import jax

    from tpu_train.compile import lower_train_step
    from tpu_train.models import LLAMA, Llama, LlamaConfig
    from tpu_train.ops import attention_tpu
    from tpu_train.parallel import sharding_plan
    from tpu_train.parallel.mesh import build_mesh

    seq = 128
    config = LlamaConfig(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=128,
                         ffn_hidden_dim=256, max_seq_len=seq)
    with torch.device("meta"):
        model = Llama(config)
        tokens = torch.empty(2, seq, dtype=torch.int64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mesh = build_mesh(1, 2, 1, devices=jax.devices()[:2], split_sizes=LLAMA.split_sizes(config))
    with attention_tpu.interpreted(min_sequence=seq):
        program = lower_train_step(model, optimizer, lm_loss,
                                   {"tokens": tokens, "labels": tokens.clone()}, mesh=mesh,
                                   plan=sharding_plan(LLAMA), compute_dtype=torch.bfloat16,
                                   scan_layers=True, runtime_options=False, compile=False)
    scans = [n for n in program.grad_graph.graph.nodes if n.target is LAYER_SCAN]
    assert len(scans) == 1 and len(scans[0].args[1]) == 2 * 9 + 3
    assert "while" in program.lowered.as_text()
