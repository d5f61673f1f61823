"""Which layers of a model form a stack to scan, and the trace-time hooks that scan them.

A **group** is an ``nn.ModuleList`` of at least two modules of one class with the same
parameters and buffers (names, shapes, dtypes), the same non-tensor attributes (apart from
ones holding the layer's own index, like ``layer_idx``) and the same ``forward`` (all
checkpointed or none). Layers that differ in anything else — Gemma 2's alternating sliding
window is an attribute — are traced one by one as before.

While the gradient graph is traced, each grouped layer's ``forward`` is replaced:

* layer 0's call emits one :class:`~tpu_train.compile.layer_scan.LayerScan` for the whole group
  (all layers' current parameters, layer 0's arguments) and returns layer 0's slice of its
  stacked outputs;
* layer ``j``'s call checks that it is the next layer, that its first argument is the object
  returned for layer ``j - 1`` and that every other argument is the same object (or equal
  value) as layer 0's, and returns slice ``j``.

If the model does anything else — calls the layers out of order, transforms the activation
between two layers, passes other arguments — the check fails, the trace restarts, and that
group is traced layer by layer (so a scanned program always computes what the model's Python
computes). The body a group needs is traced on first sight of a call signature: the trace is
abandoned, the body traced (:func:`trace_body`) and the trace restarted; bodies are kept for
the next compilations in the process.

A body is not scanned (the group runs layer by layer) when it has random ops (each layer must
draw its own numbers), writes one of its inputs, returns anything but floating-point tensors,
or when its first argument and first output differ in shape or dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tpu_train.compile import layer_scan, remat_regions, tracing
from tpu_train.ops import registry

_STATIC_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)
# ``scan_layers=None`` (the default) scans stacks of at least this many layers. Measured on the
# CPU client (scripts/bench_compile_depth.py, docs/compile.md): trace + compile of a dim-512
# Llama step scanned vs unrolled 7.5 vs 5.5 s at 4 layers, 17.8 vs 14.3 s at 16, 32.3 vs
# 48.7 s at 32; the 4-layer W1 step ran 9 % slower scanned. Shallow stacks stay unrolled.
SCAN_MIN_LAYERS = 20


def min_scanned_layers(scan_layers: bool | None) -> int | None:
    """The smallest stack ``scan_layers`` scans: None for never (False), 2 for always (True),
    :data:`SCAN_MIN_LAYERS` for the default (None)."""
    if scan_layers is None:
        return SCAN_MIN_LAYERS
    return 2 if scan_layers else None


def scans(scan_layers: bool | None, n_layers: int) -> bool:
    """Would a stack of ``n_layers`` identical layers be scanned under ``scan_layers``?"""
    least = min_scanned_layers(scan_layers)
    return least is not None and n_layers >= least


_UNSCANNABLE = "unscannable"
_BODIES: dict = {}  # call signature -> LayerBody or _UNSCANNABLE


class NeedBody(Exception):
    """Raised out of a trace to trace a body first (caught by :func:`traced_with_groups`)."""

    def __init__(self, signature, layer, args, kwargs):
        super().__init__("a layer body must be traced first")
        self.signature, self.layer, self.args, self.kwargs = signature, layer, args, kwargs


class GroupBroken(Exception):
    """The model did not call a group as one stack: retrace it layer by layer."""

    def __init__(self, group: "Group", reason: str):
        super().__init__(reason)
        self.group, self.reason = group, reason


# The dtype a step's trainable floating parameters have in its forward (a compiled step's
# ``compute_dtype``); None: their own. A layer body is traced apart from the loss graph, on
# fakes made from the module's tensors, so it must cast them as the loss graph's inputs are.
_compute_dtype: contextvars.ContextVar = contextvars.ContextVar("compute_dtype", default=None)


@contextlib.contextmanager
def parameters_in(dtype: torch.dtype | None):
    """Trace layer bodies with trainable floating parameters in ``dtype`` (None: as they are)."""
    token = _compute_dtype.set(dtype)
    try:
        yield
    finally:
        _compute_dtype.reset(token)


def _traced_meta(tensor: torch.Tensor):
    compute = _compute_dtype.get()
    meta = metas([tensor])[0]
    if compute is not None and isinstance(tensor, torch.nn.Parameter) \
            and tensor.requires_grad and tensor.dtype.is_floating_point:
        return dataclasses.replace(meta, dtype=compute)
    return meta


def layer_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return (list(module.named_parameters(remove_duplicate=False))
            + list(module.named_buffers(remove_duplicate=False)))


def _state_signature(module: torch.nn.Module) -> tuple:
    return tuple((name, tuple(t.shape), t.dtype, isinstance(t, torch.nn.Parameter))
                 for name, t in layer_state(module))


def _attributes(module: torch.nn.Module) -> tuple:
    """Non-tensor attributes of the module and its submodules, ``(path, name, value)``."""
    found = []
    for prefix, sub in module.named_modules():
        for key, value in sorted(vars(sub).items()):
            if key.startswith("_") or key == "forward" or isinstance(value, torch.Tensor):
                continue
            if not isinstance(value, _STATIC_TYPES + (tuple,)):
                value = type(value)
            found.append((prefix, key, value))
    return tuple(found)


def _same_attributes(layers) -> bool:
    """Equal attributes, except ones holding each layer's own index (``layer_idx``)."""
    rows = [_attributes(layer) for layer in layers]
    if any(len(row) != len(rows[0]) for row in rows):
        return False
    for column in zip(*rows):
        if any(entry[:2] != column[0][:2] for entry in column):
            return False
        values = [entry[2] for entry in column]
        if all(v == values[0] for v in values):
            continue
        if not all(type(v) is int and v == i for i, v in enumerate(values)):
            return False
    return True


def _forward_kind(module: torch.nn.Module):
    forward = vars(module).get("forward")
    if forward is None:
        return None
    return (type(forward), getattr(forward, "func", None), remat_regions.forward_remat(forward))


def _shares_tensors(layers) -> bool:
    seen = set()
    for layer in layers:
        ids = {id(t) for _, t in layer_state(layer)}
        if ids & seen:
            return True
        seen |= ids
    return False


def find_groups(model: torch.nn.Module, min_layers: int = 2) -> list[list[torch.nn.Module]]:
    """The module lists of ``model`` (at least ``min_layers`` long) whose layers are
    interchangeable (module docstring)."""
    groups = []
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < max(2, min_layers):
            continue
        layers = list(module)
        first = layers[0]
        if not layer_state(first) or _shares_tensors(layers):
            continue
        same = all(type(layer) is type(first)
                   and _state_signature(layer) == _state_signature(first)
                   and _forward_kind(layer) == _forward_kind(first)
                   for layer in layers)
        if same and _same_attributes(layers):
            groups.append(layers)
    return groups


@dataclasses.dataclass(eq=False)
class Group:
    """One stack and the state of the current trace through it."""

    layers: list
    enabled: bool = True
    next_layer: int = 0
    stacked: list | None = None  # stacked outputs of the scan (this trace)
    returned: Any = None  # what the previous layer's call returned as its output 0
    inputs: list | None = None  # layer 0's tensor arguments
    statics: list | None = None
    spec: Any = None
    body: Any = None

    def reset(self):
        self.next_layer, self.stacked, self.returned = 0, None, None


def split_arguments(args, kwargs):
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    statics = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    return leaves, spec, tensors, statics


def _attributes_key(layer: torch.nn.Module, index: int) -> tuple:
    """The layer's attributes as part of its body's key: what a traced body bakes in (an
    ``eps``, a window), so that two models with the same shapes do not share a body. An int
    equal to the layer's own position (``layer_idx``) is keyed as "the index"."""
    key = []
    for prefix, name, value in _attributes(layer):
        if type(value) is int and value == index:
            value = "<layer index>"
        try:
            hash(value)
        except TypeError:
            value = type(value)
        key.append((prefix, name, value))
    return tuple(key)


def call_signature(layer, index, forward, spec, statics, tensors) -> tuple | None:
    """What a traced body of ``layer`` (at position ``index`` of its stack) called with these
    arguments depends on; None where an argument is an object a body cannot be keyed by."""
    if not all(isinstance(s, _STATIC_TYPES) for s in statics):
        return None  # an object argument (a cache, a config): no body for it
    autocast = (torch.is_autocast_enabled("tpu"), torch.get_autocast_dtype("tpu"))
    # ``forward``: what the layer's call runs (the instance attribute is our hook by now).
    forward_kind = (type(forward), getattr(forward, "func", None),
                    remat_regions.forward_remat(forward))
    return (type(layer), _state_signature(layer), _attributes_key(layer, index), forward_kind,
            str(spec), tuple(statics), tuple((tuple(t.shape), t.dtype) for t in tensors),
            _compute_dtype.get(), autocast, torch.is_grad_enabled())


def signature_autocast(signature: tuple) -> tuple:
    """The (enabled, dtype) autocast state a :func:`call_signature` was taken under."""
    return signature[-2]


class Tracer:
    """The forward replacements for every grouped layer during one trace attempt."""

    def __init__(self, groups: list[Group]):
        self.groups = groups

    def call(self, group: Group, index: int, forward: Callable, args, kwargs):
        layer = group.layers[index]
        if not group.enabled:
            return forward(*args, **kwargs)
        leaves, spec, tensors, statics = split_arguments(args, kwargs)
        if index == 0:
            return self._first(group, layer, forward, args, kwargs, spec, tensors, statics)
        if group.stacked is None:
            raise GroupBroken(group, f"layer {index} was called before layer 0")
        if index != group.next_layer:
            raise GroupBroken(group, f"layer {index} was called after layer "
                                     f"{group.next_layer - 1}")
        same = (str(spec) == str(group.spec) and statics == group.statics and tensors
                and tensors[0] is group.returned
                and all(a is b for a, b in zip(tensors[1:], group.inputs[1:])))
        if not same:
            raise GroupBroken(group, f"layer {index} was not called with layer {index - 1}'s "
                                     "output and layer 0's other arguments")
        return self._slice(group, index)

    def _first(self, group, layer, forward, args, kwargs, spec, tensors, statics):
        signature = call_signature(layer, 0, forward, spec, statics, tensors) if tensors \
            else None
        # Inside a checkpointed region the layer runs below the gradient transform: it is
        # recomputed as a whole there, layer by layer.
        if signature is None or not torch.is_grad_enabled() \
                or remat_regions.inside_recomputed_region():
            group.enabled = False
            return forward(*args, **kwargs)
        found = _BODIES.get(signature)
        if found is None:
            raise NeedBody(signature, layer, args, kwargs)
        if found == _UNSCANNABLE:
            group.enabled = False
            return forward(*args, **kwargs)
        states = [t for layer_ in group.layers for _, t in layer_state(layer_)]
        outputs = layer_scan.LayerScan.apply(found, len(group.layers), *states, *tensors)
        group.stacked = list(outputs[:found.n_outputs])
        group.body, group.spec, group.statics, group.inputs = found, spec, statics, tensors
        return self._slice(group, 0)

    def _slice(self, group: Group, index: int):
        outputs = [stacked[index] for stacked in group.stacked]
        group.returned = outputs[0]
        group.next_layer = index + 1
        return tree_unflatten(outputs, group.body.output_spec)

    def finish(self):
        for group in self.groups:
            if group.enabled and group.stacked is not None \
                    and group.next_layer != len(group.layers):
                raise GroupBroken(group, f"only {group.next_layer} of {len(group.layers)} "
                                         "layers were called")


@contextlib.contextmanager
def forwards_replaced(tracer: Tracer):
    replaced = []
    for group in tracer.groups:
        group.reset()
        for index, layer in enumerate(group.layers):
            previous = vars(layer).get("forward")
            forward = layer.forward

            def hooked(*args, _group=group, _index=index, _forward=forward, **kwargs):
                return tracer.call(_group, _index, _forward, args, kwargs)

            layer.forward = hooked
            replaced.append((layer, previous))
    try:
        yield
    finally:
        for layer, previous in replaced:
            if previous is None:
                del layer.forward
            else:
                layer.forward = previous


def metas(tensors) -> list:
    return [layer_scan.Meta(tuple(t.shape), t.dtype) for t in tensors]


@dataclasses.dataclass
class TracedLayer:
    """One layer call traced on fake tensors: ``gm``'s placeholders are the layer's states
    then the call's tensor arguments; it returns the leaves of the call's result."""

    gm: torch.fx.GraphModule
    state_metas: list
    input_metas: list
    outputs: list  # the result's leaves, as traced (fake tensors or other values)
    output_spec: Any
    remat: str | None  # the policy of the layer's checkpoint call; None: not checkpointed

    @property
    def checkpointed(self) -> bool:
        return self.remat is not None

    def body(self) -> "layer_scan.LayerBody":
        return layer_scan.LayerBody(self.gm, self.state_metas, self.input_metas,
                                    metas(self.outputs), self.output_spec, remat=self.remat)


def trace_layer(need: NeedBody, autocast: tuple, wrap: Callable | None = None) -> TracedLayer:
    """``need``'s layer call traced alone under ``autocast`` (enabled, dtype); ``wrap(run)``,
    if given, returns the function traced in place of ``run(*states, *inputs)``."""
    layer = need.layer
    names = [name for name, _ in layer_state(layer)]
    state_metas = [_traced_meta(t) for _, t in layer_state(layer)]
    leaves, spec, tensors, _ = split_arguments(need.args, need.kwargs)
    input_metas = metas(tensors)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    fakes = tracing.FakeFactory()
    device = tensors[0].device
    output_info = {}
    checkpointed = []

    def run_layer(*flat):
        mapping = dict(zip(names, flat[:len(names)]))
        values = list(leaves)
        for position, value in zip(positions, flat[len(names):]):
            values[position] = value
        args, kwargs = tree_unflatten(values, spec)
        out = torch.func.functional_call(layer, mapping, args, kwargs)
        out_leaves, output_info["spec"] = tree_flatten(out)
        output_info["leaves"] = out_leaves
        return out_leaves

    fake_inputs = [fakes.like(m.shape, m.dtype, device) for m in state_metas + input_metas]
    traced = run_layer if wrap is None else wrap(run_layer)
    autocast_enabled, autocast_dtype = autocast
    with fakes.mode, remat_regions.checkpoint_calls_recorded(checkpointed), \
            remat_regions.naming_values(), \
            torch.autocast("tpu", dtype=autocast_dtype, enabled=autocast_enabled):
        gm = tracing.trace_forward(traced, fake_inputs)
    return TracedLayer(gm, state_metas, input_metas, output_info["leaves"],
                       output_info["spec"], checkpointed[0][1] if checkpointed else None)


def trace_body(need: NeedBody):
    """The body of ``need``'s layer call, or ``_UNSCANNABLE`` (module docstring)."""
    traced = trace_layer(need, signature_autocast(need.signature))
    if not _scannable(traced.gm, traced.outputs, traced.input_metas):
        return _UNSCANNABLE
    return traced.body()


def pure_graph(gm: torch.fx.GraphModule) -> bool:
    """Does ``gm`` neither write its inputs nor draw random numbers (so that it computes the
    same for every call with the same inputs)?"""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if registry.is_mutating(node.target) or node.target is torch.ops.aten.copy_.default:
            return False
        lowering = registry.get_lowering(node.target)
        if lowering is not None and lowering.draws_random(node.args, node.kwargs):
            return False
    return True


def _scannable(gm, outputs, input_metas) -> bool:
    if not outputs or not all(isinstance(o, torch.Tensor) and o.is_floating_point()
                              for o in outputs):
        return False
    if (tuple(outputs[0].shape), outputs[0].dtype) != (input_metas[0].shape,
                                                       input_metas[0].dtype):
        return False
    return pure_graph(gm)


def traced_with_groups(model: torch.nn.Module, trace: Callable[[], Any],
                       scan_layers: bool | None = None):
    """``trace()`` with the repeated layers of ``model`` scanned (module docstring), for the
    stacks ``scan_layers`` asks for (:func:`min_scanned_layers`)."""
    least = min_scanned_layers(scan_layers)
    if least is None:
        return trace()
    groups = [Group(layers) for layers in find_groups(model, least)]
    if not groups:
        return trace()
    tracer = Tracer(groups)
    while True:
        try:
            with forwards_replaced(tracer):
                result = trace()
                tracer.finish()
            return result
        except NeedBody as need:
            _BODIES[need.signature] = trace_body(need)
        except GroupBroken as broken:
            broken.group.enabled = False
