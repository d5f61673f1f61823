"""``torch.utils.checkpoint`` regions inside a traced (compiled) training step.

PyTorch's checkpoint cannot run under ``torch.func.grad``, which traces the gradient graph:
the non-reentrant variant installs saved-tensor hooks ("torch.func.{grad, ...} don't yet
support saved tensor hooks"), the reentrant one calls ``torch.autograd.backward`` inside
backward. While a step is traced, :func:`traced_checkpoints` therefore routes every
``checkpoint(function, *args)`` call to :func:`_traced_checkpoint`, which computes the same
values and gradients with a recomputing ``torch.autograd.Function``:

* forward: ``function(*args)`` runs below the gradient transform, so none of its intermediate
  values is recorded for backward; only the region's inputs (its tensor arguments and the
  parameters of the module that owns ``function``) are saved;
* backward: the region is run again from the saved inputs and differentiated there
  (``torch.func.vjp``). The saved inputs and the incoming output gradients first pass through
  an ``optimization_barrier`` op (lowered by ``interpreter.fence``): without it XLA would see
  the recomputation as a copy of the forward and merge the two (CSE), storing the
  activations after all; tying it to the output gradients also keeps XLA from scheduling the
  recomputation before the backward reaches the region.

The hook point is the attribute through which ``torch._disable_dynamo`` (the decorator on
``checkpoint``) finds the function it wraps, so calls reach it however ``checkpoint`` was
imported (``from torch.utils.checkpoint import checkpoint`` included). It is installed only
for the duration of a trace.

Limits: tensors the region reads must be its arguments or parameters / buffers of the module
that owns ``function`` (a ``Module``, one of its bound methods, or a ``functools.partial`` of
either); for any other function the parameters of the whole traced model are the region's
inputs. Random ops inside a region are rejected: the recomputation would draw different
numbers (the compiled program folds a distinct key per random node).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

BARRIER_NAMESPACE = "tpu_train_compile"


# Defined with the low-level API rather than ``torch.library.custom_op``: that one always
# installs an autograd kernel, an autograd.Function that torch.func refuses inside the
# gradient transform; the barrier only ever runs inside a backward formula, which nothing
# differentiates.
_LIBRARY = torch.library.Library(BARRIER_NAMESPACE, "DEF")
_LIBRARY.define("optimization_barrier(Tensor[] tensors) -> Tensor[]")


def _barrier_identity(tensors):
    """The identity, which XLA may not see through (no CSE, no reordering across it)."""
    return [t.clone() for t in tensors]


_LIBRARY.impl("optimization_barrier", _barrier_identity, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{BARRIER_NAMESPACE}::optimization_barrier")
def _(tensors):
    return [torch.empty_like(t) for t in tensors]


OPTIMIZATION_BARRIER = torch.ops.tpu_train_compile.optimization_barrier.default
optimization_barrier = OPTIMIZATION_BARRIER

# ---------------------------------------------------------------------- remat policies
#
# What a checkpointed layer keeps for its backward (``trainer.remat``): ``full`` nothing but
# its inputs; ``save_dots`` the results of its projections (matmuls without batch dimensions);
# ``save_qkv_proj`` only the outputs of its attention's q, k and v projections, marked with
# :data:`CHECKPOINT_NAME`; ``offload`` what ``full`` keeps, with each scanned layer's input
# (the activation it is called with, :data:`LAYER_INPUT`) moved to the host's memory
# (:data:`HOST_MEMORY_KIND`) in the forward and back to the chip in the backward. The policy
# travels with the ``checkpoint`` call itself, as the ``context_fn`` PyTorch's selective
# checkpointing uses (:class:`RematContext`), so that the compiled step reads it where it
# finds the call and eager mode honours it through PyTorch.
REMAT_POLICIES = ("none", "full", "save_dots", "save_qkv_proj", "offload")
QKV_NAMES = ("q_proj", "k_proj", "v_proj")
LAYER_INPUT = "layer_input"
# JAX's memory kind of page-locked host memory, which a TPU's DMA engines read and write.
HOST_MEMORY_KIND = "pinned_host"


def host_offload_problem(devices) -> str | None:
    """Why ``trainer.remat=offload`` cannot run on ``devices`` (None: it can): each needs
    :data:`HOST_MEMORY_KIND` among the memories it addresses."""
    for device in devices:
        try:
            kinds = {memory.kind for memory in device.addressable_memories()}
        except Exception:  # noqa: BLE001 - a client without memory kinds has no host memory
            kinds = set()
        if HOST_MEMORY_KIND not in kinds:
            return (f"trainer.remat=offload moves each layer's input to host memory, which "
                    f"{device.platform} device {device.id} does not address ({HOST_MEMORY_KIND} "
                    f"is not among its memory kinds {sorted(kinds)}); use trainer.remat=full")
    return None

_LIBRARY.define("checkpoint_name(Tensor x, str name) -> Tensor")


def _named_copy(x, name):
    return x.clone()


_LIBRARY.impl("checkpoint_name", _named_copy, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{BARRIER_NAMESPACE}::checkpoint_name")
def _(x, name):
    return torch.empty_like(x)


CHECKPOINT_NAME = torch.ops.tpu_train_compile.checkpoint_name.default
# The op has no autograd formula on purpose: it is only recorded while a layer's body is traced
# forward-only (:func:`naming_values`), and JAX differentiates that body. PyTorch's autograd
# (eager mode, a layer traced inline with PyTorch's backward) never sees it.
_NAMING = [0]


@contextlib.contextmanager
def naming_values():
    """Within the block (a layer body's trace), :func:`checkpoint_name` records its op."""
    _NAMING[0] += 1
    try:
        yield
    finally:
        _NAMING[0] -= 1


def checkpoint_name(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` marked ``name`` for the remat policies that save named values: while a
    layer body is traced, a :data:`CHECKPOINT_NAME` op (lowered to JAX's
    ``checkpoint_name``); anywhere else ``tensor`` itself."""
    if not _NAMING[0]:
        return tensor
    return CHECKPOINT_NAME(tensor, name)


class RematContext:
    """The ``context_fn`` of a checkpointed layer's ``checkpoint`` call: carries the policy
    (``remat``) for the compiled step and, called by PyTorch in eager mode, returns its
    selective checkpointing contexts: ``save_dots`` keeps the outputs of ``mm``/``addmm``;
    ``full``, ``save_qkv_proj`` and ``offload`` keep nothing (op by op, the q/k/v projections
    are matmuls like the others: eager recomputes the whole layer; its inputs stay where they
    are)."""

    _SAVED_OPS = {"save_dots": ("mm", "addmm")}

    def __init__(self, remat: str):
        if remat not in REMAT_POLICIES[1:]:
            raise ValueError(f"a checkpointed layer's remat policy must be one of "
                             f"{', '.join(REMAT_POLICIES[1:])}, got {remat!r}")
        self.remat = remat

    def __call__(self):
        from torch.utils.checkpoint import (CheckpointPolicy,
                                            create_selective_checkpoint_contexts)

        saved = self._SAVED_OPS.get(self.remat)
        if saved is None:
            return contextlib.nullcontext(), contextlib.nullcontext()

        def policy(ctx, op, *args, **kwargs):
            name = op.__name__.split(".")[0] if hasattr(op, "__name__") else str(op)
            return (CheckpointPolicy.MUST_SAVE if name in saved
                    else CheckpointPolicy.PREFER_RECOMPUTE)

        return create_selective_checkpoint_contexts(policy)

    def __eq__(self, other):
        return isinstance(other, RematContext) and other.remat == self.remat

    def __hash__(self):
        return hash(("RematContext", self.remat))


def remat_of_call(kwargs: dict) -> str:
    """The remat policy of a ``checkpoint(...)`` call's keyword arguments: ``full`` unless its
    ``context_fn`` is a :class:`RematContext`."""
    context = kwargs.get("context_fn")
    return context.remat if isinstance(context, RematContext) else "full"


def checkpointed_forward(context: RematContext, forward, *args, **kwargs):
    """``forward(*args, **kwargs)`` under ``torch.utils.checkpoint`` with ``context``'s policy
    (a layer's forward, replaced on the instance by a ``functools.partial`` of this)."""
    from torch.utils.checkpoint import checkpoint

    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


def forward_remat(forward) -> str | None:
    """The remat policy a layer's (instance) ``forward`` applies, or None: not checkpointed
    by :func:`checkpointed_forward`."""
    if isinstance(forward, functools.partial) and forward.func is checkpointed_forward:
        return forward.args[0].remat
    return None


class UnsupportedCheckpointError(NotImplementedError):
    """A checkpointed region the compiled step cannot recompute faithfully."""


OFFLOAD_UNSCANNED = ("trainer.remat=offload moves the inputs of scanned layers to host memory, "
                     "and a checkpointed layer of this step is not scanned: set "
                     "trainer.scan_layers=true (layers with random ops are never scanned), or "
                     "use trainer.remat=full")


def _owner_module(function: Callable, root: torch.nn.Module | None):
    """The module whose parameters ``function`` reads (see the module docstring)."""
    while isinstance(function, functools.partial):
        function = function.func
    if isinstance(function, torch.nn.Module):
        return function
    owner = getattr(function, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return owner
    return root


def _tensor_slots(module: torch.nn.Module | None) -> list[tuple[dict, str]]:
    """``(container, name)`` of every distinct tensor (parameter or buffer, of any dtype) under
    ``module``, ``container`` being the submodule's ``_parameters`` or ``_buffers``.

    All of them go into the recomputed function as its inputs: the trace passes the module's
    tensors as arguments of the gradient transform, so each one is a wrapper of that level, and
    one merely captured by the region (an int8 frozen weight, a buffer) would reach the level
    below it, where such a wrapper is dead (functorch's "wrapper == nullptr")."""
    if module is None:
        return []
    slots, seen = [], set()
    for submodule in module.modules():
        for container in (submodule._parameters, submodule._buffers):
            for name, value in container.items():
                if value is None or id(value) in seen:
                    continue
                seen.add(id(value))
                slots.append((container, name))
    return slots


@contextlib.contextmanager
def _tensors_set_to(slots, values):
    """Temporarily make ``values`` the tensors in ``slots`` (as functional_call does)."""
    previous = [container[name] for container, name in slots]
    for (container, name), value in zip(slots, values):
        container[name] = value
    try:
        yield
    finally:
        for (container, name), value in zip(slots, previous):
            container[name] = value


class _RejectRandomOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            raise UnsupportedCheckpointError(
                f"random op {func} inside a torch.utils.checkpoint region of a compiled step: "
                "its recomputation would draw different numbers. Move the random op out of "
                "the checkpointed region (or disable it, e.g. dropout=0).")
        return func(*args, **(kwargs or {}))


_REGION_DEPTH = [0]


def inside_recomputed_region() -> bool:
    """Is a checkpointed region's function running (below the gradient transform)?"""
    return _REGION_DEPTH[0] > 0


class _Region:
    """One checkpoint call: the function, its non-tensor arguments and where tensors go."""

    def __init__(self, function, args, kwargs, root):
        self.function = function
        self.flat_args, self.args_spec = tree_flatten((args, kwargs))
        self.tensor_positions = [i for i, a in enumerate(self.flat_args)
                                 if isinstance(a, torch.Tensor)]
        self.slots = _tensor_slots(_owner_module(function, root))
        self.out_spec = None

    def inputs(self) -> list[torch.Tensor]:
        return ([self.flat_args[i] for i in self.tensor_positions]
                + [container[name] for container, name in self.slots])

    def run(self, tensors) -> list[torch.Tensor]:
        flat = list(self.flat_args)
        n_args = len(self.tensor_positions)
        for position, value in zip(self.tensor_positions, tensors[:n_args]):
            flat[position] = value
        args, kwargs = tree_unflatten(flat, self.args_spec)
        _REGION_DEPTH[0] += 1
        try:
            with _tensors_set_to(self.slots, tensors[n_args:]):
                out = self.function(*args, **kwargs)
        finally:
            _REGION_DEPTH[0] -= 1
        leaves, self.out_spec = tree_flatten(out)
        for leaf in leaves:
            if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
                raise UnsupportedCheckpointError(
                    "a checkpointed function in a compiled step must return floating-point "
                    f"tensors (a pytree of them); got a {type(leaf).__name__}"
                    + (f" of dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor) else ""))
        return leaves


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(region, *tensors):
        with _RejectRandomOps():
            return tuple(region.run(list(tensors)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        region, *tensors = inputs
        ctx.region = region
        ctx.save_for_backward(*tensors)

    @staticmethod
    def backward(ctx, *grad_outputs):
        region = ctx.region
        saved = list(ctx.saved_tensors)
        wanted = [i for i, needed in enumerate(ctx.needs_input_grad[1:]) if needed]
        if not wanted:
            return (None,) * (1 + len(saved))
        fenced = optimization_barrier(saved + list(grad_outputs))
        inputs, cotangents = fenced[:len(saved)], fenced[len(saved):]

        def region_of(*differentiated):
            values = list(inputs)
            for i, value in zip(wanted, differentiated):
                values[i] = value
            return tuple(region.run(values))

        _, vjp = torch.func.vjp(region_of, *[inputs[i] for i in wanted])
        grads = vjp(tuple(cotangents))
        result: list[Any] = [None] * len(saved)
        for i, grad in zip(wanted, grads):
            result[i] = grad
        return (None, *result)


_ROOT: list[torch.nn.Module | None] = [None]
_CHECKPOINT_OPTIONS = ("use_reentrant", "preserve_rng_state", "context_fn", "determinism_check",
                       "debug", "early_stop")


def _traced_checkpoint(function, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` while a compiled step is traced."""
    if remat_of_call(kwargs) == "offload":
        raise UnsupportedCheckpointError(OFFLOAD_UNSCANNED)
    for option in _CHECKPOINT_OPTIONS:
        kwargs.pop(option, None)
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    region = _Region(function, args, kwargs, _ROOT[0])
    outputs = _Recompute.apply(region, *region.inputs())
    return tree_unflatten(list(outputs), region.out_spec)


def _checkpoint_target():
    """The undecorated ``torch.utils.checkpoint.checkpoint``, whose ``__dynamo_disable``
    attribute the decorator calls (see the module docstring)."""
    import torch.utils.checkpoint as checkpoint_module

    target = getattr(checkpoint_module.checkpoint, "__wrapped__", None)
    if target is None:
        raise UnsupportedCheckpointError(
            "this torch version's torch.utils.checkpoint.checkpoint cannot be redirected for "
            "tracing; activation checkpointing is not supported in compiled steps here")
    return target


# autograd.Functions whose forward is all functionalize needs to see (their ops are handled one
# by one); see _functionalize_rule_for_recompute. Other modules of this layer add theirs.
FORWARD_UNDER_FUNCTIONALIZE: set = set()


@contextlib.contextmanager
def _functionalize_rule_for_recompute():
    """Let ``_Recompute`` run under ``torch.func.functionalize`` (the trace's outer transform).

    ``torch.func.grad`` handles an autograd.Function at its own level and passes the call on
    to the next transform down, functionalize, which has no rule for autograd.Functions yet
    ("NYI"). Below the gradient level nothing differentiates any more, so the rule for ours is
    simply its forward, whose ops functionalize handles one by one. Other functions keep the
    original rule."""
    from torch._C._functorch import TransformType
    from torch._functorch.autograd_function import custom_function_call

    table = custom_function_call.functorch_table
    original = table.get(TransformType.Functionalize)

    def rule(interpreter, autograd_function, *operands, **kwargs):
        if autograd_function is _Recompute or autograd_function in FORWARD_UNDER_FUNCTIONALIZE:
            return autograd_function.forward(*operands)
        return original(interpreter, autograd_function, *operands, **kwargs)

    table[TransformType.Functionalize] = rule
    try:
        yield
    finally:
        table[TransformType.Functionalize] = original


@contextlib.contextmanager
def traced_checkpoints(root: torch.nn.Module | None):
    """Within the block, ``checkpoint(...)`` calls build recomputed regions (module docstring).

    ``root`` is the traced model: its parameters are the inputs of regions whose function
    belongs to no module."""
    target = _checkpoint_target()
    attribute = "__dynamo_disable"
    missing = object()
    previous = target.__dict__.get(attribute, missing)
    previous_root = _ROOT[0]
    setattr(target, attribute, _traced_checkpoint)
    _ROOT[0] = root
    try:
        with _functionalize_rule_for_recompute():
            yield
    finally:
        _ROOT[0] = previous_root
        if previous is missing:
            delattr(target, attribute)
        else:
            setattr(target, attribute, previous)


@contextlib.contextmanager
def checkpoint_calls_recorded(calls: list):
    """Within the block, ``checkpoint(function, ...)`` runs ``function`` as is and appends it
    to ``calls`` with its remat policy (:func:`remat_of_call`): a layer's body is traced
    forward only, and its layer's policy decides how its backward is taken (see
    :mod:`.layer_scan`)."""
    target = _checkpoint_target()
    attribute = "__dynamo_disable"
    missing = object()
    previous = target.__dict__.get(attribute, missing)

    def recorded(function, *args, **kwargs):
        remat = remat_of_call(kwargs)
        for option in _CHECKPOINT_OPTIONS:
            kwargs.pop(option, None)
        calls.append((function, remat))
        return function(*args, **kwargs)

    setattr(target, attribute, recorded)
    try:
        yield
    finally:
        if previous is missing:
            delattr(target, attribute)
        else:
            setattr(target, attribute, previous)
