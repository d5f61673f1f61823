"""One traced optimizer update per distinct parameter signature, shared by the parameters with it.

The hand-written optimizer adapters (:mod:`.functional_optim`) update each parameter on its
own: the same chain of ops for every parameter with the same shape, dtype and state. Traced
parameter by parameter, a 32-layer Llama's AdamW update is ~3,200 graph nodes, each paid
for once by ``make_fx`` (fake tensors, functionalization, proxies) and again by the lowering
to JAX; that cost grows with depth even when the layers themselves run as one scanned body.

Here each distinct signature — param group, parameter, gradient and state shapes and dtypes,
clipping or not — is traced once into a :class:`Template` (a small FX graph), and the update
graph, built node by node around them (:meth:`TemplatedUpdate.graph`), holds one
``template_map(template, tensors)`` node per template, applied to every parameter with its
signature. Lowered, a template is one ``jax.jit`` function (traced once per length) that every
parameter's slice of the node calls; XLA inlines the calls, so the program is the one the
per-parameter trace gave (same ops on the same values).

A template traced on flat tensors whose graph names no length (elementwise arithmetic on
``(n,)`` tensors and 0-dim scalars, as Adam's, AdamW's and SGD's updates and the 2-norm are)
also serves every other length: the parameters of one group, dtype and state signature share
it whatever their sizes (W1: two templates instead of ten), and ``jax.jit`` specializes it per
length when the program is lowered. The same holds for the natural shapes a TPU step updates
(:func:`.program.natural_layout`): a template traced on ``(a, b)`` tensors whose graph names
neither ``a``, ``b`` nor ``a * b`` serves every 2-D shape, so there a model's parameters share
one template per rank of their shapes (a Llama: its 1-D norm weights and its matrices).

Only adapters that declare ``per_parameter = True`` (the update of one parameter reads nothing
of the others) take this path; an optimizer's traced ``step()`` may couple its parameters and
is traced whole.
"""

from __future__ import annotations

import itertools
import math
import operator
import weakref
from typing import Sequence

import jax
import torch

from tpu_train.compile import interpreter, remat_regions, stacked_layers, tracing

_LIBRARY = torch.library.Library(remat_regions.BARRIER_NAMESPACE, "FRAGMENT")
_LIBRARY.define("template_map(int template, Tensor[] tensors) -> Tensor[]")
TEMPLATE_MAP = torch.ops.tpu_train_compile.template_map.default

_TEMPLATES: "weakref.WeakValueDictionary[int, Template]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


class Template:
    """A traced per-tensor function (``n_inputs`` placeholders, a list of outputs) that a
    ``template_map`` node applies to each consecutive ``n_inputs`` of its tensors."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.id = next(_IDS)
        self.gm = gm
        self.n_inputs = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
        output = next(n for n in gm.graph.nodes if n.op == "output")
        self.output_metas = [(tuple(n.meta["val"].shape), n.meta["val"].dtype)
                             for n in output.args[0]]
        # The shape it was traced for, if it serves every shape of that rank (module docstring).
        self.any_shape = _shape_free(gm)
        self._jitted = None
        _TEMPLATES[self.id] = self

    @property
    def any_length(self) -> int | None:
        """The length n it was traced for, if it is flat and serves every flat length."""
        return self.any_shape[0] if self.any_shape is not None and len(self.any_shape) == 1 \
            else None

    def output_shapes(self, first_input_shape: tuple) -> list[tuple]:
        """Shapes of one call's outputs, for a call whose first input has this shape."""
        if self.any_shape is None:
            return [shape for shape, _ in self.output_metas]
        return [first_input_shape if shape == self.any_shape else shape
                for shape, _ in self.output_metas]

    @property
    def n_outputs(self) -> int:
        return len(self.output_metas)

    def lowered(self):
        """The template as a JAX function, traced once for all the tensors that share it."""
        if self._jitted is None:
            gm = self.gm
            self._jitted = jax.jit(lambda *values: interpreter.run_graph(gm, list(values))[0])
        return self._jitted


def template(template_id: int) -> Template:
    found = _TEMPLATES.get(template_id)
    if found is None:
        raise RuntimeError(f"template {template_id} is gone: the program that used it was freed")
    return found


def _not_run(*_):
    raise RuntimeError("template_map only exists inside a traced compiled step")


_LIBRARY.impl("template_map", _not_run, "CompositeExplicitAutograd")


def _map_outputs(t: Template, tensors: Sequence[torch.Tensor], empty) -> list:
    """``empty(shape, dtype, device)`` for each output of ``t`` mapped over ``tensors``."""
    device = tensors[0].device
    return [empty(shape, dtype, device)
            for start in range(0, len(tensors), t.n_inputs)
            for shape, (_, dtype) in zip(t.output_shapes(tuple(tensors[start].shape)),
                                         t.output_metas)]


@torch.library.register_fake(f"{remat_regions.BARRIER_NAMESPACE}::template_map")
def _(template_id, tensors):
    return _map_outputs(template(template_id), tensors,
                        lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device=device))


def _ints(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _ints(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _ints(item)
    elif type(value) is int:
        yield value


def _shape_free(gm: torch.fx.GraphModule) -> tuple | None:
    """The shape ``s`` if ``gm`` was traced on tensors of one shape ``s`` (flat or not, every
    dimension at least 2), 0-dim scalars and short vectors of other lengths, every output is
    ``s``-shaped or of another input's or a 0-dim shape, and no op argument is an int equal to
    a dimension of ``s`` or to its element count: the same graph then computes the same ops for
    any shape of that rank. None otherwise (a dimension that equals some index or count in the
    graph is taken for a size: such a template is simply not shared)."""
    shapes = [tuple(n.meta["val"].shape) for n in gm.graph.nodes
              if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    if not shapes or not shapes[0]:
        return None
    shape = shapes[0]
    if min(shape) < 2 or any(s != shape and len(s) > 1 for s in shapes):
        return None
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if any(tuple(n.meta["val"].shape) not in shapes + [()] for n in output.args[0]):
        return None
    sizes = set(shape) | {math.prod(shape)}
    for node in gm.graph.nodes:
        if node.op == "call_function" and any(i in sizes for i in _ints((node.args, node.kwargs))):
            return None
    return shape


def _lower_template_map(template_id: int, tensors: Sequence, constrain=None, uses=None):
    t = template(template_id)
    function = t.lowered()
    calls = [list(tensors[start:start + t.n_inputs])
             for start in range(0, len(tensors), t.n_inputs)]
    results: list = [None] * len(calls)
    for positions in _stacked_calls(calls):
        _vmapped(function, calls, positions, results)
    return [value for position, call in enumerate(calls)
            for value in (results[position] or function(*call))]


def _stacked_calls(calls: Sequence[list]) -> list[list[int]]:
    """Groups of calls that are one stack's layers (:mod:`.stacked_layers`), in layer order:
    each call's views are of the same stacks at one layer, its other inputs the very values
    of the group's other calls."""
    groups: dict[tuple, dict[int, int]] = {}
    for position, call in enumerate(calls):
        key, layers = [], set()
        for value in call:
            found = stacked_layers.source(value)
            key.append(("value", id(value)) if found is None else ("stack", id(found[0])))
            if found is not None:
                layers.add(found[1])
        if len(layers) == 1:
            groups.setdefault(tuple(key), {}).setdefault(layers.pop(), position)
    complete = []
    for by_layer in groups.values():
        positions = [by_layer.get(layer) for layer in range(len(by_layer))]
        first = calls[positions[0]] if None not in positions else None
        if first is not None and len(positions) > 1 and all(
                stacked_layers.source(v) is None
                or stacked_layers.source(v)[0].shape[0] == len(positions) for v in first):
            complete.append(positions)
    return complete


def _vmapped(function, calls: Sequence[list], positions: list[int], results: list) -> None:
    """One ``vmap`` of ``function`` over the stacks of the calls at ``positions`` (one per
    layer); each call's results are views of the stacked results."""
    first = calls[positions[0]]
    sources = [stacked_layers.source(v) for v in first]
    args = [v if found is None else found[0] for v, found in zip(first, sources)]
    axes = [None if found is None else 0 for found in sources]
    stacked = jax.vmap(function, in_axes=axes)(*args)
    for layer, position in enumerate(positions):
        results[position] = [stacked_layers.view(out, layer) for out in stacked]


interpreter.GRAPH_OPS[TEMPLATE_MAP] = _lower_template_map


def trace_template(fn, fakes: tracing.FakeFactory, like: Sequence[torch.Tensor]) -> Template:
    """``fn`` traced on fresh fake tensors shaped like ``like`` (outside any other trace)."""
    args = [fakes.like(t.shape, t.dtype, t.device) for t in like]
    with fakes.mode, torch.autocast("tpu", enabled=False):
        return Template(tracing.trace_forward(fn, args))


def _map_nodes(graph: torch.fx.Graph, fakes: tracing.FakeFactory,
               calls: Sequence[tuple[Template, Sequence[torch.fx.Node]]]) -> list[list]:
    """``graph`` gets one ``template_map`` node per distinct template among ``calls`` (each a
    ``(template, input nodes)``); returns each call's output nodes, in the order of ``calls``."""
    by_template: dict[int, list[int]] = {}
    for position, (t, _) in enumerate(calls):
        by_template.setdefault(t.id, []).append(position)
    results: list = [None] * len(calls)
    for template_id, positions in by_template.items():
        t = calls[positions[0]][0]
        inputs = [x for p in positions for x in calls[p][1]]
        node = graph.call_function(TEMPLATE_MAP, (template_id, inputs))
        node.meta["val"] = _map_outputs(t, [x.meta["val"] for x in inputs], fakes.like)
        for k, p in enumerate(positions):
            results[p] = [_item(graph, node, k * t.n_outputs + j) for j in range(t.n_outputs)]
    return results


def _item(graph: torch.fx.Graph, node: torch.fx.Node, index: int) -> torch.fx.Node:
    item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = node.meta["val"][index]
    return item


def _placeholder(graph: torch.fx.Graph, name: str, value: torch.Tensor) -> torch.fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = value
    return node


def _inline(graph: torch.fx.Graph, root: torch.nn.Module, gm: torch.fx.GraphModule,
            inputs: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
    """``gm``'s nodes copied into ``graph`` with its placeholders bound to ``inputs`` (its
    constants onto ``root``); returns the nodes of its outputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            setattr(root, node.target, getattr(gm, node.target))
    return list(graph.graph_copy(gm.graph, dict(zip(placeholders, inputs))))


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype


class _Templates:
    """Templates by the signature of their inputs; a shape-free template (module docstring)
    also answers for inputs of the same dtypes whose first input's shape, and those of the
    inputs shaped like it, is any other of the same rank (the other inputs' shapes equal)."""

    def __init__(self):
        self._exact: dict = {}
        self._any_shape: dict = {}

    @staticmethod
    def _shape_free_key(key, like):
        shape = tuple(like[0].shape)
        if not shape:
            return None
        return key, len(shape), tuple(
            (t.dtype, "first" if tuple(t.shape) == shape else tuple(t.shape)) for t in like)

    def get(self, key, like: Sequence[torch.Tensor], trace) -> Template:
        exact = (key, tuple(_meta(t) for t in like))
        found = self._exact.get(exact)
        loose = self._shape_free_key(key, like)
        if found is None and loose is not None:
            found = self._any_shape.get(loose)
        if found is None:
            found = trace()
            if found.any_shape is not None and loose is not None:
                self._any_shape[loose] = found
        self._exact[exact] = found
        return found

    def all(self) -> list[Template]:
        return list({id(t): t for t in self._exact.values()}.values())


class TemplatedUpdate:
    """Gradient norms and the per-parameter optimizer update as ``template_map`` nodes.

    Built before the update graph's trace (templates are traced here, not inside it): one
    norm template per gradient signature, one update template per param group, parameter and
    state signature and clipping.
    """

    def __init__(self, adapter, group_settings: Sequence[dict], fakes: tracing.FakeFactory,
                 param_fakes: Sequence, state_fakes: Sequence[Sequence], group_of: Sequence[int],
                 scalars_fake: torch.Tensor, clip: bool):
        row = fakes.like(scalars_fake.shape[1:], scalars_fake.dtype, scalars_fake.device)
        norms, updates = _Templates(), _Templates()
        self._norm_of: list[Template] = []
        self._update_of: list[Template] = []
        self._group_of = list(group_of)
        for param, states, group in zip(param_fakes, state_fakes, group_of):
            self._norm_of.append(norms.get("norm", [param], lambda: trace_template(
                lambda g: [torch.linalg.vector_norm(g, 2)], fakes, [param])))
            like = [param, param, *states, row]
            if clip:
                like.append(fakes.like((), param.dtype, param.device))
            update = _one_parameter(adapter, group_settings[group], len(states), clip)
            self._update_of.append(updates.get(
                group, like, lambda: trace_template(update, fakes, like)))
        self.templates = norms.all() + updates.all()  # kept alive with a graph

    def graph(self, fakes: tracing.FakeFactory, param_fakes: Sequence, grad_fakes: Sequence,
              state_fakes: Sequence, state_counts: Sequence[int], scalars_fake: torch.Tensor,
              max_grad_norm: float | None) -> torch.fx.GraphModule:
        """The update graph (``tracing.trace_update_graph``'s placeholders and outputs), built
        node by node: a ``make_fx`` trace of it would wrap every parameter, gradient and state
        tensor (W1: 313 inputs, 235 outputs) only to record a handful of nodes. The part between
        the norms and the updates (global norm, clip coefficient, each group's scalars) is
        traced on its own, on the per-parameter norms."""
        graph, root = torch.fx.Graph(), torch.nn.Module()
        params = [_placeholder(graph, f"param_{i}", f) for i, f in enumerate(param_fakes)]
        grads = [_placeholder(graph, f"grad_{i}", f) for i, f in enumerate(grad_fakes)]
        flat_states = [_placeholder(graph, f"state_{i}", f) for i, f in enumerate(state_fakes)]
        scalars = _placeholder(graph, "scalars", scalars_fake)
        norms = [out[0] for out in _map_nodes(graph, fakes, [
            (t, [g]) for t, g in zip(self._norm_of, grads)])]

        groups = list(dict.fromkeys(self._group_of))
        dtypes = list(dict.fromkeys(g.dtype for g in grad_fakes)) if max_grad_norm is not None else []

        def between(*flat):  # per-parameter norms, then the [groups, k] scalars
            grad_norm = tracing.global_grad_norm(list(flat[:-1]))
            coefs = []
            if max_grad_norm is not None:
                coef = tracing.clip_coefficient(grad_norm, max_grad_norm)
                coefs = [coef.to(dtype) for dtype in dtypes]
            return [grad_norm] + coefs + [flat[-1][g] for g in groups]

        with fakes.mode, torch.autocast("tpu", enabled=False):
            between_gm = tracing.trace_forward(between, [n.meta["val"] for n in norms]
                                               + [scalars_fake])
        grad_norm, *rest = _inline(graph, root, between_gm, norms + [scalars])
        coef_of = dict(zip(dtypes, rest[:len(dtypes)]))
        row_of = dict(zip(groups, rest[len(dtypes):]))

        calls, cursor = [], 0
        for t, p, g, count, group in zip(self._update_of, params, grads, state_counts,
                                         self._group_of):
            inputs = [p, g, *flat_states[cursor:cursor + count], row_of[group]]
            cursor += count
            calls.append((t, inputs + ([coef_of[g.meta["val"].dtype]] if coef_of else [])))
        outputs = _map_nodes(graph, fakes, calls)
        new_params = [out[0] for out in outputs]
        new_states = [x for out in outputs for x in out[1:]]
        graph.output(new_params + new_states + [grad_norm])
        gm = torch.fx.GraphModule(root, graph)
        gm.meta["update_templates"] = self.templates  # alive as long as the graph
        return gm


def _one_parameter(adapter, settings: dict, n_states: int, clip: bool):
    def one_parameter(param, grad, *rest):
        states, scalars = list(rest[:n_states]), rest[n_states]
        if clip:
            grad = grad * rest[n_states + 1]
        new_params, new_states = adapter.update(settings, [param], [grad], [states], scalars)
        return [new_params[0]] + list(new_states[0])
    return one_parameter
