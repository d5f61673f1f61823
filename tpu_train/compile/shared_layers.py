"""Repeated layers traced once and called once per layer, in the loss graph.

The loss graph (:mod:`.loss_graph`) is the step's forward, for JAX to differentiate. Traced op
by op, a decoder stack adds every layer's ops to it again: ``make_fx`` traces each copy, and
the lowering interprets and differentiates each copy. Here the layers of a group
(:func:`.layer_groups.find_groups`: interchangeable layers of one ``nn.ModuleList``) are traced
once per call signature into a :class:`~.layer_scan.LayerBody`, and the loss graph holds one
``layer_call(body, states + inputs)`` node per layer. Lowered, the body is one ``jax.jit``
function that every layer's node calls with that layer's own parameters: JAX traces,
differentiates and lowers it once, and XLA inlines the calls, so the program computes what
the layer-by-layer graph computes (the same ops on the same values: bit for bit on the CPU
client; XLA's TPU compiler fuses the two programs differently, so there they agree to float32
rounding).

Unlike a scan (:mod:`.layer_scan`), a call needs nothing of its neighbours: each layer may be
called with any arguments of the same signature, in any order, and its parameters stay
separate arrays. A layer is traced inline, as before, where its call does not fit: an argument
that is neither a tensor nor a plain value (a cache object), a body that draws random numbers
(each layer needs its own) or writes its inputs, a result whose leaves are not all tensors. A
layer checkpointed with a selective policy (``trainer.remat=save_dots|save_qkv_proj``) is a
body with that policy, whose calls are differentiated through ``jax.checkpoint`` with it
(:func:`.layer_scan.jax_policy`); a ``full`` one is traced inline (the step then traces
PyTorch's backward and its recomputation, :mod:`.remat_regions`).

As for scans, an int attribute holding a layer's own position (``layer_idx``) is taken for
bookkeeping (a KV-cache slot) and keyed as "the index"; every other attribute is part of the
body's key, so two models with the same shapes but another ``eps`` get bodies of their own.

The body is traced under what the rest of the loss graph is traced under (``wrap_body``: the
autograd probe, under ``torch.func.vjp`` of the call's tensors that require grad), so a layer's
own ``detach()`` ends the trace as it would inline.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Sequence

import jax
import torch
from torch.utils._pytree import tree_unflatten

from tpu_train.compile import interpreter, layer_groups, layer_scan, remat_regions

_LIBRARY = torch.library.Library(remat_regions.BARRIER_NAMESPACE, "FRAGMENT")
_LIBRARY.define("layer_call(int body, Tensor[] tensors) -> Tensor[]")
LAYER_CALL = torch.ops.tpu_train_compile.layer_call.default

_NOT_SHARED = "not shared"
# (call signature, requires_grad of each tensor) -> LayerBody or _NOT_SHARED. Kept for the
# process's next compilations, like the scanned bodies.
_BODIES: dict = {}


def _not_run(*_):
    raise RuntimeError("layer_call only exists inside a traced compiled step")


_LIBRARY.impl("layer_call", _not_run, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{remat_regions.BARRIER_NAMESPACE}::layer_call")
def _(body_id, tensors):
    device = tensors[0].device
    return [torch.empty(m.shape, dtype=m.dtype, device=device)
            for m in layer_scan.body(body_id).output_metas]


def _lower_layer_call(body_id: int, tensors: Sequence, constrain=None, uses=None) -> list:
    body = layer_scan.body(body_id)
    jitted = body.jitted(constrain)
    uses = uses or [None] * len(tensors)

    def call(*values):
        # Inside the checkpoint: a recomputation reads (gathers) the stored weights again.
        return list(jitted(*[t if use is None else use(t) for t, use in zip(values, uses)]))

    if body.remat == "offload":
        raise checkpointing.UnsupportedCheckpointError(checkpointing.OFFLOAD_UNSCANNED)
    if body.remat is not None:
        policy = layer_scan.jax_policy(body.remat)
        call = _recomputed(call, policy) if _FENCED.get() \
            else jax.checkpoint(call, policy=policy)
    return call(*tensors)


# Whether the program is for the CPU client (set by build_program around its trace and
# lowering): a recomputed layer's backward then starts from fenced residuals
# (:func:`_recomputed`), as XLA's CPU pipeline removes jax.checkpoint's barriers, and a
# ``full`` layer is PyTorch's recomputation (:func:`_trace_body`). XLA's TPU
# compiler keeps them, so its program needs no per-layer conditionals (a 16-layer 1B step
# with save_dots, compiled for a v5e: 26.44 GiB unfenced, 26.59 GiB fenced).
_FENCED: contextvars.ContextVar = contextvars.ContextVar("fenced_recomputation", default=True)


@contextlib.contextmanager
def recomputation_fenced(fenced: bool):
    """Within the block, recomputed layers are lowered fenced (the CPU client) or not."""
    token = _FENCED.set(fenced)
    try:
        yield
    finally:
        _FENCED.reset(token)


def _recomputed(function: Callable, policy) -> Callable:
    """``function`` differentiated through ``jax.checkpoint`` with ``policy``, its backward
    starting from fenced residuals (:func:`.interpreter.fence`, tied to the incoming
    gradient): left to ``jax.checkpoint``'s own barriers, XLA's CPU pipeline merged the
    recomputation with the forward and kept every activation (measured: no memory saved)."""
    checkpointed = jax.checkpoint(function, policy=policy)

    @jax.custom_vjp
    def run(*values):
        return checkpointed(*values)

    def forward(*values):
        return jax.vjp(checkpointed, *values)

    def backward(pullback, cotangents):
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        cot_leaves, cot_tree = jax.tree_util.tree_flatten(cotangents)
        # The fence's last value is the one it waits for: an incoming gradient.
        fenced = interpreter.fence(leaves + cot_leaves[1:] + cot_leaves[:1])
        pullback = jax.tree_util.tree_unflatten(treedef, fenced[:len(leaves)])
        cot_leaves = fenced[len(leaves):]
        cotangents = jax.tree_util.tree_unflatten(cot_tree, cot_leaves[-1:] + cot_leaves[:-1])
        return tuple(pullback(cotangents))

    run.defvjp(forward, backward)
    return run


def has_remat_calls(gm: torch.fx.GraphModule) -> bool:
    """Does ``gm`` call a layer with a remat policy (a recomputed layer)?"""
    return any(node.target is LAYER_CALL and layer_scan.body(node.args[0]).remat is not None
               for node in gm.graph.nodes)


interpreter.GRAPH_OPS[LAYER_CALL] = _lower_layer_call
interpreter.ORDERED_GRAPH_OPS.add(LAYER_CALL)


def called_layers(gm: torch.fx.GraphModule) -> int:
    """How many ``layer_call`` nodes ``gm`` has (layers traced once, called per layer)."""
    return sum(1 for node in gm.graph.nodes if node.target is LAYER_CALL)


class _CallTracer:
    """The forward replacement of every grouped layer: a ``layer_call`` where a body fits."""

    def __init__(self, groups: list):
        self.groups = groups

    def call(self, group, index: int, forward: Callable, args, kwargs):
        layer = group.layers[index]
        # Inside a checkpointed region the layer runs below the gradient transform.
        if not torch.is_grad_enabled() or remat_regions.inside_recomputed_region():
            return forward(*args, **kwargs)
        _, spec, tensors, statics = layer_groups.split_arguments(args, kwargs)
        signature = layer_groups.call_signature(layer, index, forward, spec, statics, tensors) \
            if tensors else None
        if signature is None:
            return forward(*args, **kwargs)
        states = [t for _, t in layer_groups.layer_state(layer)]
        # The platform's choice of lowering is part of the key (``full``: see _trace_body).
        key = (signature, tuple(t.requires_grad for t in states + tensors), _FENCED.get())
        body = _BODIES.get(key)
        if body is None:
            raise layer_groups.NeedBody(key, layer, args, kwargs)
        if body is _NOT_SHARED:
            return forward(*args, **kwargs)
        outputs = LAYER_CALL(body.id, states + tensors)
        return tree_unflatten(list(outputs), body.output_spec)


def _trace_body(need: layer_groups.NeedBody, wrap_body: Callable | None):
    signature, requires, fenced = need.signature
    wrap = None if wrap_body is None else (lambda run: wrap_body(run, requires))
    try:
        traced = layer_groups.trace_layer(need, layer_groups.signature_autocast(signature), wrap)
    except Exception:  # noqa: BLE001 - traced inline instead, where any error is the user's
        return _NOT_SHARED
    # A checkpointed layer's body keeps its remat policy: its call is differentiated through
    # ``jax.checkpoint`` (``trace_layer`` records the checkpoint call instead of running it).
    # On the CPU client ``full`` stays inline, where the probe sends the step to PyTorch's
    # backward and its recomputation: under FSDP that kept less per layer than the JAX form
    # (8 devices: +0.23 vs +0.44 MB per layer, tests/parallel/test_compiled_spmd.py). For a
    # TPU the JAX form: PyTorch's backward left the Pallas attention kernels out, and the 1B
    # step (16 layers, compiled for a v5e) did 57.7 TFLOP and moved 571 GB against 47.6 and
    # 247 (docs/compile.md, "Remat policies").
    if (traced.remat == "full" and fenced) or not traced.outputs \
            or not all(isinstance(o, torch.Tensor) for o in traced.outputs) \
            or not layer_groups.pure_graph(traced.gm):
        return _NOT_SHARED
    return traced.body()


def traced_with_shared_layers(model: torch.nn.Module, trace: Callable[[], Any],
                              wrap_body: Callable | None = None):
    """``trace()`` with each grouped layer of ``model`` a ``layer_call`` (module docstring).

    ``wrap_body(run, requires)`` returns the function to trace for a body in place of
    ``run(*states, *inputs)``; ``requires[i]``: does that tensor require grad in the call."""
    groups = [layer_groups.Group(layers) for layers in layer_groups.find_groups(model, 2)]
    if not groups:
        return trace()
    tracer = _CallTracer(groups)
    while True:
        try:
            with layer_groups.forwards_replaced(tracer):
                return trace()
        except layer_groups.NeedBody as need:
            _BODIES[need.signature] = _trace_body(need, wrap_body)
