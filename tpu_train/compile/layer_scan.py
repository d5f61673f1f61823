"""Repeated layers as one traced body run under ``lax.scan`` (the graph op and its lowering).

A decoder stack calls ``N`` layers of one class with the same parameter shapes, one after the
other. Traced op by op, every layer adds its own copy of the same ops to the graph, and XLA
compiles all ``N`` copies: trace and compile time grow with depth. Here a layer's forward is
traced **once** (:class:`LayerBody`, an FX graph over its parameters and inputs), and the whole
stack is one node of the gradient graph, ``layer_scan(body, states of all N layers, inputs)``,
whose backward is one ``layer_scan_backward`` node. Lowered, the forward is a ``lax.scan``
over the layers' stacked parameters that also stacks what the backward needs (the residuals of
``jax.vjp`` of one layer), and the backward a reverse ``lax.scan`` that applies each layer's
``vjp`` with the incoming gradient as its carry. Program size no longer depends on ``N``.

Numerics are those of the unrolled program: the same lowerings run on the same values; only
XLA's fusion decisions can differ (float32 rounding, tested within 1e-5).

Residuals: JAX's ``vjp`` of one layer returns a function whose pytree leaves are what its
backward reads. Some leaves are the layer's own inputs (a weight, the incoming activation):
those are not stacked again but taken from where they already are (the stacked parameters, the
stacked layer inputs, the loop-invariant inputs); the others are computed and stacked by the
forward scan. Which values are kept is JAX's ``dots_with_no_batch_dims_saveable`` policy: the
results of the layer's projections (matmuls without batch dimensions) are stored, the
elementwise ops around them (norms, activations, RoPE) and the attention scores are recomputed
in backward. Keeping every intermediate instead (plain ``vjp``: 60 stacked residuals per W1
layer, transposed weights among them) made the step slower and its compile longer; with the
policy (6 residuals) the W1 step needs less temporary memory than the unrolled program
(docs/compile.md, with the figures). A layer whose
forward was wrapped in ``torch.utils.checkpoint`` is differentiated through ``jax.checkpoint``
with its remat policy (:func:`jax_policy`): ``full`` keeps its inputs only and its backward
recomputes it; ``save_dots`` is the policy above; ``save_qkv_proj`` keeps only the values
marked ``q_proj``/``k_proj``/``v_proj`` (:func:`.remat_regions.checkpoint_name`); ``offload``
keeps the layer's input, named ``layer_input``, in host memory (JAX's
``save_and_offload_only_these_names``): the forward scan stacks it there as a computed
residual, the backward scan brings each layer's back, and the stacked layer outputs on the
chip are no longer read by the backward.

:mod:`tpu_train.compile.layer_groups` decides which layers form a stack and traces the body.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import weakref
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import torch
from jax.ad_checkpoint import checkpoint_name

from tpu_train.compile import interpreter, remat_regions, stacked_layers
from tpu_train.ops import attention_tpu
from tpu_train.ops.dtypes import storage_dtype, torch_dtype

_LIBRARY = torch.library.Library(remat_regions.BARRIER_NAMESPACE, "FRAGMENT")
_LIBRARY.define("layer_scan(int body, Tensor[] tensors) -> Tensor[]")
_LIBRARY.define("layer_scan_backward(int body, Tensor[] tensors) -> Tensor[]")

_BODIES: "weakref.WeakValueDictionary[int, LayerBody]" = weakref.WeakValueDictionary()
def _unbatched_dot(prim, params) -> bool:
    return prim is jax.lax.dot_general_p and not params["dimension_numbers"][1][0]


def _dots_with_no_batch_dims_saveable(prim, *_, **params) -> bool:
    """JAX's ``dots_with_no_batch_dims_saveable``, also for the low-precision dots of
    ``tpu_train.ops.matmul`` (a ``custom_vjp`` around one ``dot_general``), which JAX's policy
    does not see: under bf16 it kept no projection's output (the program was ``full``'s)."""
    if _unbatched_dot(prim, params):
        return True
    if prim.name == "custom_vjp_call":
        jaxpr = getattr(params["call_jaxpr"], "jaxpr", params["call_jaxpr"])
        return any(_unbatched_dot(eqn.primitive, eqn.params) for eqn in jaxpr.eqns)
    return False


_SAVED_RESIDUALS = _dots_with_no_batch_dims_saveable


def jax_policy(remat: str):
    """The ``jax.checkpoint`` policy of a remat policy name (``trainer.remat``)."""
    if remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    if remat == "save_dots":
        return _SAVED_RESIDUALS
    if remat == "save_qkv_proj":
        return jax.checkpoint_policies.save_only_these_names(*remat_regions.QKV_NAMES)
    if remat == "offload":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(),
            names_which_can_be_offloaded=(remat_regions.LAYER_INPUT,),
            offload_src="device", offload_dst=remat_regions.HOST_MEMORY_KIND)
    raise ValueError(f"remat policy must be one of {', '.join(remat_regions.REMAT_POLICIES[1:])}"
                     f", got {remat!r}")
_IDS = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class Meta:
    """Shape and torch dtype of one tensor."""

    shape: tuple
    dtype: torch.dtype

    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, storage_dtype(self.dtype))


@dataclasses.dataclass(frozen=True)
class ResidualLayout:
    """Where each leaf of one layer's ``vjp`` function comes from: ``("computed", k)`` (the
    k-th stacked residual), ``("state", s)``, ``("carry", 0)`` or ``("input", i)``."""

    sources: tuple
    treedef: Any
    computed: tuple  # Meta of each computed residual (one layer's)
    # attention_tpu.lowering_key() when found: a body lowered under another attention form
    # (the fused kernels or the XLA form) may keep other residuals.
    attention_form: tuple = ()


class LayerBody:
    """One layer's forward as a traced graph: placeholders ``states + inputs``.

    ``states``: the layer's parameters and buffers (one per slot, the same slots in every
    layer); ``inputs``: the tensor arguments of its call, the same for every layer except the
    ``carry`` (input ``0``, which is the previous layer's output ``0``)."""

    def __init__(self, gm: torch.fx.GraphModule, state_metas: Sequence[Meta],
                 input_metas: Sequence[Meta], output_metas: Sequence[Meta], output_spec,
                 remat: str | None = None):
        self.id = next(_IDS)
        self.gm = gm
        self.state_metas = tuple(state_metas)
        self.input_metas = tuple(input_metas)
        self.output_metas = tuple(output_metas)
        self.output_spec = output_spec
        # The layer's remat policy (``trainer.remat``); None: the layer was not checkpointed.
        self.remat = remat
        self._layout: ResidualLayout | None = None
        self.lowered_treedef = None  # set by the forward's lowering, read by the backward's
        self._jitted: dict = {}
        _BODIES[self.id] = self

    @property
    def checkpointed(self) -> bool:
        return self.remat is not None

    @property
    def n_states(self) -> int:
        return len(self.state_metas)

    @property
    def n_inputs(self) -> int:
        return len(self.input_metas)

    @property
    def n_outputs(self) -> int:
        return len(self.output_metas)

    def differentiable(self) -> list[bool]:
        """Per state then input: is it floating point (does it get a gradient)?"""
        return [m.dtype.is_floating_point for m in self.state_metas + self.input_metas]

    # ------------------------------------------------------------------ one layer, in JAX

    def run(self, states: Sequence, inputs: Sequence, constrain=None) -> list:
        outputs, mutations = interpreter.run_graph(self.gm, list(states) + list(inputs),
                                                   constrain=constrain)
        if mutations:
            raise interpreter.MissingLoweringError("a scanned layer wrote one of its inputs")
        return list(outputs)

    def jitted(self, constrain=None) -> Callable:
        """One layer as a ``jax.jit`` function of ``*states, *inputs`` returning its outputs:
        JAX traces it once however many layers call it (:mod:`.shared_layers`)."""
        # Traced once per constraint and per choice of attention lowering (a body traced for
        # one device must not serve a partitioned program).
        key = (constrain, attention_tpu.lowering_key())
        found = self._jitted.get(key)
        if found is None:
            n = self.n_states
            found = jax.jit(lambda *values: self.run(values[:n], values[n:], constrain))
            self._jitted[key] = found
        return found

    def vjp(self, states: Sequence, inputs: Sequence, constrain=None):
        """``(outputs, vjp function, its leaves, their sources)`` of one layer."""
        values = list(states) + list(inputs)
        wanted = [i for i, d in enumerate(self.differentiable()) if d]

        def layer(*differentiated):
            full = list(values)
            for i, value in zip(wanted, differentiated):
                full[i] = value
            if self.remat == "offload":  # the value its policy moves to host memory
                full[self.n_states] = checkpoint_name(full[self.n_states],
                                                      remat_regions.LAYER_INPUT)
            return self.run(full[:self.n_states], full[self.n_states:], constrain)

        # Not checkpointed: keep the projections' products, recompute the elementwise rest in
        # backward (module docstring: stacking every residual made the step slower).
        layer = jax.checkpoint(layer, policy=jax_policy(self.remat or "save_dots"))
        outputs, pullback = jax.vjp(layer, *[values[i] for i in wanted])
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        sources, computed = [], 0
        for leaf in leaves:
            source = next((i for i, v in enumerate(values) if leaf is v), None)
            if source is None:
                sources.append(("computed", computed))
                computed += 1
            elif source < self.n_states:
                sources.append(("state", source))
            elif source == self.n_states:
                sources.append(("carry", 0))
            else:
                sources.append(("input", source - self.n_states))
        return outputs, treedef, leaves, tuple(sources)

    def layout(self) -> ResidualLayout:
        """The residual layout, found once by an abstract evaluation of :meth:`vjp`."""
        if self._layout is None:
            found = {}

            def probe(states, inputs):
                _, treedef, leaves, sources = self.vjp(states, inputs)
                found["treedef"], found["sources"] = treedef, sources
                return [leaf for leaf, s in zip(leaves, sources) if s[0] == "computed"]

            shapes = jax.eval_shape(probe, [m.abstract() for m in self.state_metas],
                                    [m.abstract() for m in self.input_metas])
            computed = tuple(Meta(tuple(s.shape), torch_dtype(s.dtype)) for s in shapes)
            self._layout = ResidualLayout(found["sources"], found["treedef"], computed,
                                          attention_tpu.lowering_key())
        return self._layout


def body(body_id: int) -> LayerBody:
    found = _BODIES.get(body_id)
    if found is None:
        raise RuntimeError(f"layer body {body_id} is gone: the program that used it was freed")
    return found


# ---------------------------------------------------------------------- the graph ops
#
# ``layer_scan(body, tensors)``: tensors = the N layers' states (layer-major) + the inputs.
# Returns each output stacked over layers ([N, ...]), then the computed residuals stacked.
# ``layer_scan_backward(body, tensors)``: tensors = the forward's tensors + all its outputs
# (stacked outputs, then residuals) + the cotangents of its stacked outputs. Returns the gradient of every state of
# every layer (layer-major) and of every input (an empty tensor where not floating point).

LAYER_SCAN = torch.ops.tpu_train_compile.layer_scan.default
LAYER_SCAN_BACKWARD = torch.ops.tpu_train_compile.layer_scan_backward.default


def _count(b: LayerBody, tensors: Sequence) -> int:
    return (len(tensors) - b.n_inputs) // b.n_states if b.n_states else 0


def largest_stack(gm: torch.fx.GraphModule) -> int:
    """The most layers one ``layer_scan`` of ``gm`` runs (0: none): how many layer indices a
    program passes in (:func:`layer_indices`)."""
    return max((_count(body(node.args[0]), node.args[1]) for node in gm.graph.nodes
                if node.target is LAYER_SCAN), default=0)


# Layer j's gradients are read out of the backward scan's stacked result [N, ...] for the
# optimizer. Read with the constant j (a static slice), XLA fuses the slice into each
# parameter's update and gradient-norm fusions, so that every layer's fusions differ by their
# offset and each is compiled on its own: at 32 layers nearly all of the program's kernels,
# and XLA's CPU compile time grows with depth. Read at an index that is a program input, the
# fusions of a slot are one computation for every layer, compiled once.
_layer_index_inputs: Sequence | None = None


@contextlib.contextmanager
def layer_indices(values: Sequence):
    """While a step program is traced: ``values[j]``, a traced int32 scalar input holding ``j``,
    is where the backward stack reads layer ``j``'s gradients."""
    global _layer_index_inputs
    previous, _layer_index_inputs = _layer_index_inputs, values
    try:
        yield
    finally:
        _layer_index_inputs = previous


def _layer_slice(stacked, layer: int):
    """Layer ``layer`` of ``stacked``, a view of it (:mod:`.stacked_layers`): a step that
    holds the stack's parameters stacked updates them with ``stacked`` itself."""
    if _layer_index_inputs is not None and layer < len(_layer_index_inputs):
        value = jax.lax.dynamic_index_in_dim(stacked, _layer_index_inputs[layer], keepdims=False)
    else:
        value = stacked[layer]
    return stacked_layers.register(value, stacked, layer)


def _backward_count(b: "LayerBody", tensors: Sequence) -> int:
    """How many layers a ``layer_scan_backward`` of ``b`` over ``tensors`` runs."""
    return (len(tensors) - b.n_inputs - len(b.layout().computed) - 2 * b.n_outputs) // b.n_states


def _is_zeros(node) -> bool:
    aten = torch.ops.aten
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target in (aten.zeros.default, aten.zeros_like.default):
        return True
    return node.target is aten.full.default and node.args[1] == 0


def pass_last_layer_cotangents(gm: torch.fx.GraphModule) -> int:
    """Where the cotangent of a stack's stacked output is zeros but for the last layer's slice
    (the step reads the stack only at its end: the next op takes the last layer's output),
    give the backward that slice alone: it adds it to the last layer's cotangent instead of
    reading ``N`` layers of zeros made for it (at 32,768 tokens of the 1B, 2 GiB). Returns how
    many cotangents were replaced."""
    aten, replaced = torch.ops.aten, 0
    for node in gm.graph.nodes:
        if node.target is not LAYER_SCAN_BACKWARD:
            continue
        b, tensors = body(node.args[0]), list(node.args[1])
        n, before = _backward_count(b, tensors), replaced
        for k in range(b.n_outputs):
            position = len(tensors) - b.n_outputs + k
            cot = tensors[position]
            if isinstance(cot, torch.fx.Node) and cot.target is aten.select_scatter.default \
                    and _is_zeros(cot.args[0]) and cot.args[2] == 0 \
                    and cot.args[3] in (n - 1, -1):
                tensors[position] = cot.args[1]
                replaced += 1
        if replaced != before:
            node.args = (node.args[0], tensors)
    if replaced:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return replaced


def scanned_layer_count(gm: torch.fx.GraphModule) -> int:
    """How many layers the gradient graph ``gm`` runs inside ``layer_scan`` loops."""
    return sum(_count(body(node.args[0]), node.args[1]) for node in gm.graph.nodes
               if node.target is LAYER_SCAN)


def _not_run(*_):
    raise RuntimeError("layer_scan only exists inside a traced compiled step")


_LIBRARY.impl("layer_scan", _not_run, "CompositeExplicitAutograd")
_LIBRARY.impl("layer_scan_backward", _not_run, "CompositeExplicitAutograd")


def _empty(meta: Meta, device, leading: tuple = ()) -> torch.Tensor:
    return torch.empty(leading + meta.shape, dtype=meta.dtype, device=device)


@torch.library.register_fake(f"{remat_regions.BARRIER_NAMESPACE}::layer_scan")
def _(body_id, tensors):
    b = body(body_id)
    n, device = _count(b, tensors), tensors[0].device
    return ([_empty(m, device, (n,)) for m in b.output_metas]
            + [_empty(m, device, (n,)) for m in b.layout().computed])


@torch.library.register_fake(f"{remat_regions.BARRIER_NAMESPACE}::layer_scan_backward")
def _(body_id, tensors):
    b = body(body_id)
    device = tensors[0].device
    n = _backward_count(b, tensors)
    grads = [_empty(m, device) for _ in range(n) for m in b.state_metas]
    return grads + [_empty(m if m.dtype.is_floating_point else Meta((0,), torch.float32), device)
                    for m in b.input_metas]


class LayerScan(torch.autograd.Function):
    """The stack's forward and backward for ``torch.func.grad`` (outputs stacked over layers;
    the residual outputs are not differentiable)."""

    @staticmethod
    def forward(b: LayerBody, n: int, *tensors):
        return tuple(LAYER_SCAN(b.id, list(tensors)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        b, n, *tensors = inputs
        ctx.body, ctx.count = b, n
        ctx.mark_non_differentiable(*output[b.n_outputs:])
        # The stacked outputs too: layer j's carry input is layer j - 1's output.
        ctx.save_for_backward(*tensors, *output)

    @staticmethod
    def backward(ctx, *cotangents):
        b, n = ctx.body, ctx.count
        saved = list(ctx.saved_tensors)
        grads = LAYER_SCAN_BACKWARD(b.id, saved + list(cotangents[:b.n_outputs]))
        differentiable = b.differentiable()
        per_tensor = []
        for layer in range(n):
            for s in range(b.n_states):
                g = grads[layer * b.n_states + s]
                per_tensor.append(g if differentiable[s] else None)
        for i in range(b.n_inputs):
            per_tensor.append(grads[n * b.n_states + i] if differentiable[b.n_states + i]
                              else None)
        needs = ctx.needs_input_grad[2:]
        return (None, None, *[g if need else None for g, need in zip(per_tensor, needs)])


remat_regions.FORWARD_UNDER_FUNCTIONALIZE.add(LayerScan)


# ---------------------------------------------------------------------- lowering


def _stacked_states(b: LayerBody, flat: Sequence, n: int) -> list:
    """Each slot's ``n`` layers stacked: the program's stacked argument itself where they are
    its views (:mod:`.stacked_layers`)."""
    return [stacked_layers.restack([flat[layer * b.n_states + s] for layer in range(n)])
            for s in range(b.n_states)]


def _read(values: Sequence, uses: Sequence | None) -> list:
    """``values`` as an op reads them: through their at-use function (an FSDP all-gather of
    one layer's weight, inside the loop) where the graph has one."""
    if not uses:
        return list(values)
    return [value if use is None else use(value) for value, use in zip(values, uses)]


def _slot_uses(b: LayerBody, n: int, uses: Sequence | None):
    """Per state slot, the at-use function of layer 0's tensor (the same for every layer: the
    plan gives a slot one sharding), and the inputs' own."""
    if not uses:
        return None, None
    return list(uses[:b.n_states]), list(uses[n * b.n_states:n * b.n_states + b.n_inputs])


def lower_layer_scan(body_id: int, tensors: Sequence, constrain: Callable | None = None,
                     uses: Sequence | None = None) -> list:
    """The forward stack: ``lax.scan`` of one layer over the stacked states."""
    b = body(body_id)
    n = _count(b, tensors)
    states = _stacked_states(b, tensors, n)
    state_uses, input_uses = _slot_uses(b, n, uses)
    inputs = _read(tensors[n * b.n_states:], input_uses)
    layout = b.layout()

    def one_layer(carry, layer_states):
        layer_states = _read(layer_states, state_uses)
        layer_inputs = [carry] + inputs[1:]
        outputs, treedef, leaves, sources = b.vjp(layer_states, layer_inputs, constrain)
        if sources != layout.sources:
            raise RuntimeError(_changed_residuals(layout))
        # The backward lowering (later in the same program trace) rebuilds the vjp function
        # with this structure: one found by another trace does not compare equal.
        b.lowered_treedef = treedef
        computed = [leaf for leaf, s in zip(leaves, sources) if s[0] == "computed"]
        return outputs[0], (list(outputs), computed)

    _, (outputs, computed) = jax.lax.scan(one_layer, inputs[0], states)
    return list(outputs) + list(computed)


def _changed_residuals(layout: ResidualLayout) -> str:
    message = "a scanned layer's residuals changed between two traces"
    now = attention_tpu.lowering_key()
    if now != layout.attention_form:
        message += (f": its step was traced with attention lowering {layout.attention_form} "
                    f"and lowered with {now} (attention_tpu.lowering_key); trace and lower "
                    "it under the same one")
    return message


def lower_layer_scan_backward(body_id: int, tensors: Sequence,
                              constrain: Callable | None = None,
                              uses: Sequence | None = None) -> list:
    """The backward stack: a reverse ``lax.scan`` applying each layer's ``vjp``."""
    b = body(body_id)
    layout = b.layout()
    n_computed, n_out = len(layout.computed), b.n_outputs
    n = (len(tensors) - b.n_inputs - n_computed - 2 * n_out) // b.n_states
    states = _stacked_states(b, tensors, n)
    state_uses, input_uses = _slot_uses(b, n, uses)
    cursor = n * b.n_states
    inputs = _read(tensors[cursor:cursor + b.n_inputs], input_uses)
    cursor += b.n_inputs
    outputs = list(tensors[cursor:cursor + n_out])
    cursor += n_out
    computed = list(tensors[cursor:cursor + n_computed])
    cursor += n_computed
    cotangents = list(tensors[cursor:cursor + n_out])
    # A cotangent of one layer's shape is the last layer's alone (pass_last_layer_cotangents).
    last_only = [c.ndim == len(m.shape) for c, m in zip(cotangents, b.output_metas)]
    stacked_cotangents = [c for c, last in zip(cotangents, last_only) if not last]
    differentiable = b.differentiable()
    wanted = [i for i, d in enumerate(differentiable) if d]
    # Layer j's carry input: the stack's input for j = 0, layer j - 1's output after; not
    # read where the residuals hold it (``offload``: in host memory).
    carries = jnp.concatenate([inputs[0][None], outputs[0][:-1]]) \
        if any(kind == "carry" for kind, _ in layout.sources) else None

    def one_layer(carry_grad, xs):
        layer_states, layer_computed, layer_carry, layer, layer_cotangents = xs
        stacked_cot = iter(layer_cotangents)
        layer_cotangents = [
            jnp.where(layer == n - 1, c, 0) if last else next(stacked_cot)
            for c, last in zip(cotangents, last_only)]
        layer_states = _read(layer_states, state_uses)
        values = list(layer_states) + [layer_carry] + inputs[1:]
        leaves = []
        for kind, index in layout.sources:
            if kind == "computed":
                leaves.append(layer_computed[index])
            elif kind == "state":
                leaves.append(layer_states[index])
            elif kind == "carry":
                leaves.append(layer_carry)
            else:
                leaves.append(inputs[index])
        pullback = jax.tree_util.tree_unflatten(b.lowered_treedef, leaves)
        cot = list(layer_cotangents)
        cot[0] = cot[0] + carry_grad.astype(cot[0].dtype)
        grads = pullback(cot)
        full = [None] * len(values)
        for i, g in zip(wanted, grads):
            full[i] = g
        state_grads = [full[s] for s in range(b.n_states) if differentiable[s]]
        input_grads = [full[b.n_states + i] for i in range(1, b.n_inputs)
                       if differentiable[b.n_states + i]]
        return full[b.n_states], (state_grads, input_grads)

    init = jnp.zeros(inputs[0].shape, inputs[0].dtype)
    carry_grad, (state_grads, input_grads) = jax.lax.scan(
        one_layer, init, (states, computed, carries, jnp.arange(n), stacked_cotangents),
        reverse=True)
    result = []
    grads_by_slot = iter(state_grads)
    stacked = [next(grads_by_slot) if differentiable[s] else None for s in range(b.n_states)]
    for layer in range(n):
        for s, m in enumerate(b.state_metas):
            result.append(_layer_slice(stacked[s], layer) if stacked[s] is not None
                          else jnp.zeros(m.shape, storage_dtype(m.dtype)))
    summed = iter(input_grads)
    for i, m in enumerate(b.input_metas):
        if i == 0:
            result.append(carry_grad)
        elif differentiable[b.n_states + i]:
            result.append(next(summed).sum(axis=0))
        else:
            result.append(jnp.zeros((0,), jnp.float32))
    return result


interpreter.GRAPH_OPS[LAYER_SCAN] = lower_layer_scan
interpreter.GRAPH_OPS[LAYER_SCAN_BACKWARD] = lower_layer_scan_backward


def _lower_checkpoint_name(value, name: str, constrain=None, uses=None):
    return checkpoint_name(value, name)


interpreter.GRAPH_OPS[remat_regions.CHECKPOINT_NAME] = _lower_checkpoint_name
