"""The optimizer update traced once per distinct parameter signature (compile/update_templates.py).

The hand-written adapters (Adam, AdamW, SGD) update each parameter on its own, so the update
graph holds one ``template_map`` node per signature instead of every parameter's ops: its size
no longer grows with depth, and the program computes what the per-parameter trace computed.
"""

from __future__ import annotations

import dataclasses
import operator

import pytest
import torch

from tests import tolerances
from tests.tolerances import loss_rtol
from tpu_train.compile import lower_train_step
from tpu_train.compile.functional_optim import AdamAdapter, SGDAdapter
from tpu_train.compile.program import natural_layout
from tpu_train.compile.update_templates import TEMPLATE_MAP
from tpu_train.device import runtime
from tpu_train.models import Llama, LlamaConfig

from .helpers import (OPTIMIZERS, TINY_LLAMA_FUNCTIONS, assert_params_within, lm_batches,
                      lm_loss, param_bound, run_compiled, tiny_llama)

F32 = torch.float32


_CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128,
                      ffn_hidden_dim=176, max_seq_len=32)


def _update_graph(n_layers: int, make_opt, max_grad_norm=1.0) -> torch.fx.GraphModule:
    cfg = dataclasses.replace(_CONFIG, n_layers=n_layers)
    with torch.device("meta"):
        model = Llama(cfg)
        batch = {"tokens": torch.empty(2, 32, dtype=torch.int64),
                 "labels": torch.empty(2, 32, dtype=torch.int64)}
    program = lower_train_step(model, make_opt(model.parameters()), lm_loss, batch,
                               max_grad_norm=max_grad_norm, compile=False, scan_layers=True)
    return program.update_graph


def _ops(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem]


def _layout_ranks(natural: bool, params) -> set:
    """The ranks of the parameters as the step's update sees them: flat buffers on the CPU
    client, their own shapes in the natural layout (a TPU: program.natural_layout)."""
    return {p.dim() if natural else 1 for p in params}


@pytest.mark.parametrize("layout", ["flat", "natural"])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_update_graph_does_not_grow_with_depth(name, layout, monkeypatch):
    # Both layouts on every platform: the program is only lowered, from a model on meta.
    natural = layout == "natural"
    monkeypatch.setattr(runtime, "natural_buffers", lambda platform_name: natural)
    shallow, deep = _update_graph(2, OPTIMIZERS[name]), _update_graph(6, OPTIMIZERS[name])
    assert _ops(shallow) == _ops(deep)  # node for node: the same graph, only more getitems
    assert _ops(deep).count(TEMPLATE_MAP) == len(deep.meta["update_templates"])
    # The updates of one dtype and state signature name no size: one norm template and one
    # update template serve every parameter (embedding, attention, MLP, norm weights) of a
    # rank. Flat, every parameter is 1-D; in natural shapes the norm weights are 1-D and the
    # matrices 2-D, so one pair each.
    with torch.device("meta"):
        ranks = _layout_ranks(natural, Llama(_CONFIG).parameters())
    assert ranks == ({1, 2} if natural else {1})
    assert len(deep.meta["update_templates"]) == 2 * len(ranks)
    assert sorted(len(t.any_shape) for t in deep.meta["update_templates"]) == \
        sorted(2 * list(ranks))


def test_a_template_that_names_its_length_is_not_shared():
    from tpu_train.compile.tracing import FakeFactory
    from tpu_train.compile.update_templates import trace_template

    fakes = FakeFactory()
    device = torch.device("tpu", 0)
    elementwise = trace_template(lambda p: [p * 2.0 + 1.0], fakes,
                                 [fakes.like((6,), F32, device)])
    assert elementwise.any_length == 6
    assert elementwise.output_shapes((10,)) == [(10,)]
    sized = trace_template(lambda p: [p + torch.arange(6, device=p.device)], fakes,
                           [fakes.like((6,), F32, device)])
    assert sized.any_length is None
    assert sized.output_shapes((10,)) == [(6,)]


def test_an_optimizer_traced_whole_is_not_split_into_templates():
    # A traced step() may couple its parameters: it stays one trace of the whole group.
    _, _, _, step = run_compiled(tiny_llama(), lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
                                 lm_loss, lm_batches(1))
    (program,) = step.cache.entries.values()
    assert TEMPLATE_MAP not in _ops(program.update_graph)
    assert "update_templates" not in program.update_graph.meta


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_templated_update_computes_what_the_per_parameter_trace_computes(name, monkeypatch):
    batches = lm_batches(3)
    metrics, model, _, _ = run_compiled(tiny_llama(), OPTIMIZERS[name], lm_loss, batches,
                                        max_grad_norm=0.5)
    monkeypatch.setattr(AdamAdapter, "per_parameter", False)
    monkeypatch.setattr(SGDAdapter, "per_parameter", False)
    ref_metrics, ref_model, _, ref_step = run_compiled(tiny_llama(), OPTIMIZERS[name], lm_loss,
                                                       batches, max_grad_norm=0.5)
    (program,) = ref_step.cache.entries.values()
    assert TEMPLATE_MAP not in _ops(program.update_graph)  # the reference is the plain trace
    # The same arithmetic in two differently shaped programs: XLA may block their dots
    # differently, so the bounds are float32 rounding over the tiny Llama's chained reductions
    # (tests/tolerances.py); a wrong template (state, group or clipping) moves parameters by
    # about the learning rate, far outside them.
    steps, reduction, depth = len(batches), 128, 2 * (6 * 2 + 2)
    functions = 2 * TINY_LLAMA_FUNCTIONS  # forward and backward
    for m, ref in zip(metrics, ref_metrics):
        assert m["loss"] == pytest.approx(ref["loss"], rel=loss_rtol(
            F32, steps, reduction, functions=TINY_LLAMA_FUNCTIONS))
        assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=loss_rtol(
            F32, steps, reduction, depth, functions))
    assert_params_within(model, ref_model, param_bound(name, tiny_llama(), steps, reduction,
                                                       depth=depth, functions=functions))


@pytest.mark.parametrize("layout", ["flat", "natural"])
def test_templated_update_keeps_each_param_groups_settings(layout, monkeypatch):
    # Two groups (another lr, no weight decay in the second) with clipping: each template call
    # reads its own group's row of scalars, as the per-parameter trace does.
    natural = layout == "natural"
    if natural_layout(runtime.platform()) != natural:
        if natural:  # the CPU client runs the natural layout a TPU's step has
            monkeypatch.setattr(runtime, "natural_buffers", lambda platform_name: True)
        else:
            pytest.skip(f"the {runtime.platform()} platform keeps natural buffers: the flat "
                        "layout is the CPU client's (runtime.natural_buffers)")

    def two_groups(params):
        params = list(params)
        return torch.optim.AdamW([{"params": params[:4]},
                                  {"params": params[4:], "lr": 1e-2, "weight_decay": 0.0}],
                                 lr=3e-3, weight_decay=0.1)

    batches = lm_batches(2)
    metrics, model, _, step = run_compiled(tiny_llama(), two_groups, lm_loss, batches,
                                           max_grad_norm=0.5)
    (program,) = step.cache.entries.values()
    # One norm template per rank of the layout's shapes, one update template per group and
    # rank: flat, one norm template and one update template per group; in natural shapes each
    # group has norm weights and matrices, so two of each.
    params = list(model.parameters())
    expected = len(_layout_ranks(natural, params)) + sum(
        len(_layout_ranks(natural, group)) for group in (params[:4], params[4:]))
    assert expected == (6 if natural else 3)
    assert _ops(program.update_graph).count(TEMPLATE_MAP) == expected
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AdamAdapter, "per_parameter", False)
        ref_metrics, ref_model, _, _ = run_compiled(tiny_llama(), two_groups, lm_loss, batches,
                                                    max_grad_norm=0.5)
    steps, reduction, depth = len(batches), 128, 2 * (6 * 2 + 2)
    functions = 2 * TINY_LLAMA_FUNCTIONS  # forward and backward
    for m, ref in zip(metrics, ref_metrics):
        assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=loss_rtol(
            F32, steps, reduction, depth, functions))
    # Bounds for the larger lr, 1e-2: a group given the other's row moves its parameters by
    # about the difference of the two lrs a step, far outside them.
    assert_params_within(model, ref_model, lambda name, ref: tolerances.param_atol(
        F32, 1e-2, steps, reduction=reduction, numel=ref.numel(), depth=depth,
        functions=functions))
