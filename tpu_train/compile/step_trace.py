"""Trace one training step's two graphs on fake ``tpu`` tensors: the loss graph (for JAX to
differentiate) or PyTorch's gradient graph, and the optimizer update; and what the program built
from them (:mod:`tpu_train.compile.program`) needs to know about them (:class:`TracedStep`)."""

from __future__ import annotations

import dataclasses
import operator

import torch

from tpu_train.compile import (interpreter, layer_groups, layer_scan, loss_graph, shared_layers,
                               tracing)
from tpu_train.ops import registry


def _has_random_ops(gm: torch.fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            lowering = registry.get_lowering(node.target)
            if lowering is not None and lowering.draws_random(node.args, node.kwargs):
                return True
    return False


def _mutated_placeholders(gm: torch.fx.GraphModule) -> list[int]:
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written = set()
    for node in gm.graph.nodes:
        for position in interpreter.written_arguments(node):
            if node.args[position] in placeholders:
                written.add(placeholders[node.args[position]])
    return sorted(written)


def compute_dtype_for(dtype: torch.dtype, compute: torch.dtype | None) -> torch.dtype:
    """The dtype a parameter of ``dtype`` has in the forward and backward under the step's
    ``compute_dtype``: floating parameters are cast to it, others keep their dtype."""
    return compute if compute is not None and dtype.is_floating_point else dtype


@dataclasses.dataclass
class _GradientTrace:
    """What :func:`_trace_gradients` traced: the loss graph for JAX to differentiate (``note``
    empty), or PyTorch's gradient graph and why (``note``; ``model_fallback``: the error by
    which the model's own use of autograd ended the forward's trace, which the compile log
    names)."""

    gm: torch.fx.GraphModule
    weighted: bool
    note: str = ""
    model_fallback: str = ""


def _trace_gradients(step, st, fakes, param_fakes, const_fakes, batch_fakes,
                     autodiff: str) -> _GradientTrace:
    args = (step.model, step.loss_fn, st.param_names, st.const_names, st.batch_spec, fakes,
            param_fakes, const_fakes, batch_fakes)
    scan_layers = step.settings.scan_layers
    least = layer_groups.min_scanned_layers(scan_layers)
    model_fallback = ""
    if autodiff != "jax":
        note = "autodiff='torch'"
    elif least is not None and layer_groups.find_groups(step.model, least):
        note = "scanned layers are differentiated by their own scan"
    else:
        try:
            return _GradientTrace(*loss_graph.trace_loss_graph(*args))
        except Exception as error:  # noqa: BLE001
            # TorchAutogradNeeded, or what torch.func refuses in a forward-only trace: a
            # forward that writes a buffer (BatchNorm's running statistics) writes a tensor
            # the vjp captured. PyTorch's gradient graph handles both; an error in the user's
            # code is raised by that trace as before.
            model_fallback = f"{type(error).__name__}: {error}".splitlines()[0]
            note = "the forward uses autograd itself: " + model_fallback
    gm, weighted = layer_groups.traced_with_groups(
        step.model, lambda: tracing.trace_grad_graph(*args), scan_layers)
    return _GradientTrace(gm, weighted, note, model_fallback)


@dataclasses.dataclass
class TracedStep:
    """The step's two traced graphs and what the program needs to know about them."""

    grad_gm: torch.fx.GraphModule  # the loss graph (JAX differentiates it) or PyTorch's gradients
    update_gm: torch.fx.GraphModule  # the optimizer update, on flat (or, SPMD, natural) shapes
    weighted: bool  # the loss is a (sum, count) pair: micro-batches weigh by their count
    autodiff_note: str  # empty: JAX differentiates; else why PyTorch's backward was traced
    batch_fakes: list  # one micro-batch's fake leaves (activation sharding is planned on them)
    mutated: tuple  # positions in the constants list whose values the step rewrites
    random: bool
    layer_indices: int  # the largest scanned stack: how many layer-index scalars to pass
    grad_norm_dtype: torch.dtype

    @property
    def jax_autodiff(self) -> bool:
        return not self.autodiff_note


def trace_step(step, st, scalars, stages, autodiff: str, natural: bool) -> TracedStep:
    """Trace the gradient (or loss) graph and the update graph on fake tpu tensors."""
    fakes = tracing.FakeFactory()
    k = step.settings.grad_accum_steps
    # Tracing happens on the tpu device whatever the tensors are (a planner's model lives on
    # ``meta``); where the program runs comes from ``device`` or the mesh.
    first = st.params[0].device
    tpu_device = first if first.type == "tpu" else torch.device("tpu", 0)

    def fake(t, shape=None, dtype=None):
        return fakes.like(t.shape if shape is None else shape, dtype or t.dtype, tpu_device)

    compute = step.settings.compute_dtype
    param_fakes = [fake(p, dtype=compute_dtype_for(p.dtype, compute)) for p in st.params]
    const_fakes = [fake(c) for c in st.consts]
    batch_fakes = [fake(b, (b.shape[0] // k,) + tuple(b.shape[1:])) for b in st.batch_leaves]
    with layer_groups.parameters_in(compute):
        traced = stages.time("trace", _trace_gradients, step, st, fakes, param_fakes,
                             const_fakes, batch_fakes, autodiff)
    stages.autodiff_fallback = traced.model_fallback
    settings = [dict(step.adapter.static_settings(g)) for g in step.optimizer.param_groups]

    # The update is elementwise per tensor (plus the global norm, a full reduction), so it
    # is traced on the shapes the program's parameters and state have: flat on the CPU
    # client (:func:`natural_layout`), natural elsewhere and under SPMD (a flat buffer
    # cannot carry the plan's 2-D tilings, and the update should read the gradients in the
    # plan's layout).
    def update_shape(t):
        return tuple(t.shape) if natural else (t.numel(),)

    flat_param_fakes = [fake(p, update_shape(p)) for p in st.params]
    state_fakes = [fake(s, update_shape(s)) for s in st.states]
    grad_fakes = [fake(p, update_shape(p)) for p in st.params]
    scalars_fake = fakes.like(scalars.shape, torch.float32, tpu_device)
    update_gm = stages.time("trace", tracing.trace_update_graph, step.adapter, settings,
                            st.group_sizes, st.state_counts, step.settings.max_grad_norm, fakes,
                            flat_param_fakes, grad_fakes, state_fakes, scalars_fake)
    grad_gm = traced.gm
    layer_scan.pass_last_layer_cotangents(grad_gm)
    interpreter.check_lowerings(grad_gm.graph)
    interpreter.check_lowerings(update_gm.graph)
    stages.graph_nodes = interpreter.count_ops(grad_gm) + interpreter.count_ops(update_gm)
    stages.scanned_layers = layer_scan.scanned_layer_count(grad_gm)
    stages.shared_layer_calls = shared_layers.called_layers(grad_gm)

    n_params, n_consts = len(st.params), len(st.consts)
    mutated = tuple(i - n_params for i in _mutated_placeholders(grad_gm)
                    if n_params <= i < n_params + n_consts)
    grad_norm_node = [n for n in update_gm.graph.nodes if n.op == "output"][0].args[0][-1]
    return TracedStep(grad_gm, update_gm, traced.weighted, traced.note, batch_fakes, mutated,
                       _has_random_ops(grad_gm), layer_scan.largest_stack(grad_gm),
                       grad_norm_node.meta["val"].dtype)
