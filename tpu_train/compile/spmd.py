"""SPMD placement of a compiled training step over a device mesh.

A compiled step takes lists of parameters, optimizer-state tensors, constants (buffers such as
RoPE tables) and batch tensors, and returns the new parameters and state. Under SPMD its
``jax.jit`` needs an ``in_shardings``/``out_shardings`` entry for each; :func:`step_shardings`
derives them from a sharding plan (``tpu_train.parallel.ShardingPlan``, or anything with its
``sharding_for(name, shape, mesh)``), so a step compiler only has to say which parameter each
state tensor belongs to:

* parameter ``i`` → the plan's sharding of its name;
* a state tensor shaped like its parameter (AdamW moments) → the parameter's sharding; any
  other state (step counts, scalars) → replicated;
* constants → replicated (small, read-only);
* batch tensors → leading (batch) dimension split over ``(data, fsdp, expert)``, the rest
  replicated.

Arrays must keep their natural shapes: a flattened ``[out * in]`` buffer cannot carry a
``[tensor, fsdp]`` tiling; :func:`flat_storage_sharding` says how the flat storage buffers
are split instead. This module also places a step's inputs as its executable expects
(:func:`place_global`) and pins activations per the plan's rule.

It belongs to the compile layer (the parallel layer builds meshes and plans on top of it and
re-exports these names), so that compiling a step never imports ``tpu_train.parallel``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["BATCH_AXES", "GATHERED_AXES", "PlanError", "batch_axes", "on_mesh", "StepShardings", "activation_constraint",
           "compute_sharding", "flat_storage_sharding", "place_global", "place_step_inputs",
           "PlacingExecutable", "step_shardings"]

# The batch dimension of activations is split over the data-parallel mesh axes, and over the
# expert axis (its devices each hold some experts, and each a share of the tokens).
BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")
# The axes a stored parameter is gathered over where it is used (FSDP's all-gather, over
# ``context`` too where sequences are split: tpu_train.parallel.plans.over_context); a weight
# split over ``expert`` (or ``tensor``) is used split.
GATHERED_AXES: tuple[str, ...] = ("data", "fsdp", "context")


def batch_axes(mesh) -> tuple[str, ...]:
    """The :data:`BATCH_AXES` that ``mesh`` has (a mesh built by hand may lack ``expert``)."""
    return tuple(a for a in BATCH_AXES if a in mesh.shape)


def on_mesh(spec: PartitionSpec, mesh) -> PartitionSpec:
    """``spec`` without the mesh axes ``mesh`` lacks (the plans name every axis of a
    ``tpu_train`` mesh; one built by hand may have fewer)."""

    def kept(entry):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            return entry
        axes = tuple(a for a in (entry if isinstance(entry, (tuple, list)) else (entry,))
                     if a in mesh.shape)
        return None if not axes else (axes[0] if len(axes) == 1 else axes)

    return PartitionSpec(*(kept(e) for e in spec))


class PlanError(ValueError):
    """A parameter the plan does not cover, or a spec that does not fit its array or mesh."""


@dataclasses.dataclass(frozen=True)
class StepShardings:
    """One ``NamedSharding`` per positional tensor of each input group, plus ``replicated``."""

    params: tuple[NamedSharding, ...]
    states: tuple[NamedSharding, ...]
    consts: tuple[NamedSharding, ...]
    batch: tuple[NamedSharding, ...]
    replicated: NamedSharding
    # Where the forward and backward use each parameter: its plan sharding without the batch
    # axes (the FSDP all-gather), still split over ``tensor``. See :func:`compute_sharding`.
    compute_params: tuple[NamedSharding, ...] = ()


def step_shardings(plan: Any, mesh, *, param_names: Sequence[str],
                   param_shapes: Sequence[Sequence[int]],
                   state_owners: Sequence[int | None] = (),
                   state_shapes: Sequence[Sequence[int]] = (),
                   num_consts: int = 0,
                   batch_shapes: Sequence[Sequence[int]] = ()) -> StepShardings:
    """Shardings of a step's parameters, optimizer state, constants and batch on ``mesh``.

    ``state_owners[j]`` is the index (into ``param_names``) of the parameter state tensor
    ``j`` belongs to, or ``None``. Raises :class:`PlanError` for a batch whose leading dimension
    does not split over ``data * fsdp * expert``, or lists of mismatched lengths.
    """
    if len(param_names) != len(param_shapes):
        raise PlanError(f"{len(param_names)} parameter names but {len(param_shapes)} shapes")
    if len(state_owners) != len(state_shapes):
        raise PlanError(f"{len(state_owners)} state owners but {len(state_shapes)} state shapes")
    replicated = NamedSharding(mesh, PartitionSpec())
    params = tuple(plan.sharding_for(n, s, mesh) for n, s in zip(param_names, param_shapes))
    states = []
    for j, (owner, shape) in enumerate(zip(state_owners, state_shapes)):
        if owner is None:
            states.append(replicated)
            continue
        if not 0 <= owner < len(params):
            raise PlanError(f"state tensor {j} names parameter index {owner}, but there are "
                            f"{len(params)} parameters")
        same = tuple(shape) == tuple(param_shapes[owner])
        states.append(params[owner] if same else replicated)
    ways = 1
    for axis in batch_axes(mesh):
        ways *= mesh.shape[axis]
    batch = []
    for i, shape in enumerate(batch_shapes):
        if not shape:
            batch.append(replicated)
            continue
        if shape[0] % ways:
            raise PlanError(
                f"batch tensor {i} has leading dimension {shape[0]}, which does not split over "
                f"{' * '.join(batch_axes(mesh))} = {ways} devices; make the (micro-)batch a "
                f"multiple of {ways}")
        batch.append(NamedSharding(mesh, PartitionSpec(batch_axes(mesh))))
    return StepShardings(params, tuple(states), (replicated,) * num_consts, tuple(batch),
                         replicated, tuple(compute_sharding(p) for p in params))


def compute_sharding(sharding: NamedSharding) -> NamedSharding:
    """The layout a parameter stored with ``sharding`` is used in: :data:`GATHERED_AXES` removed.

    FSDP stores a weight split over ``fsdp`` but computes with it whole (all-gathered) on a
    batch split over ``fsdp``. Left to XLA's sharding propagation, a weight split on its
    *contraction* dimension (the family plans' fallback layout, FSDP on ``in``) makes XLA
    split the matmul's contraction over ``fsdp`` and replicate the batch instead: every chip
    then holds the whole global batch's activations (measured on the compiled Llama step:
    ``[batch * seq, ffn]`` buffers of the full batch on each of 8 devices, a partial-sum
    all-reduce after every matmul). Pinning the weight to this layout where it is read makes
    the all-gather explicit; the gradient pinned back to the storage layout is reduced and
    split (a reduce-scatter on TPU).
    """

    def without_batch_axes(entry):
        axes = () if entry is None or entry is PartitionSpec.UNCONSTRAINED else \
            (tuple(entry) if isinstance(entry, (tuple, list)) else (entry,))
        kept = tuple(a for a in axes if a not in GATHERED_AXES)
        return None if not kept else (kept[0] if len(kept) == 1 else kept)

    return NamedSharding(sharding.mesh,
                         PartitionSpec(*(without_batch_axes(e) for e in sharding.spec)))


def flat_storage_sharding(sharding: NamedSharding) -> NamedSharding:
    """The sharding of a tensor's *flat* storage buffer that splits it as many ways as
    ``sharding`` splits the tensor.

    The ``tpu`` device keeps every storage as one flat buffer, and a flat array can only be
    cut into contiguous blocks, so the plan's tiling of ``[out, in]`` (say ``(tensor, fsdp)``)
    cannot always be the buffer's own layout (it is when every split is on the leading dimension,
    as in the family plans). The buffer is split in row-major blocks over
    the same mesh axes, in the spec's order: every device holds the same number of bytes as
    under the plan, and a compiled step reshapes and re-pins it to the plan's layout inside
    the program. A replicated ``sharding`` gives a replicated buffer.
    """
    axes: list[str] = []
    for entry in sharding.spec:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        for axis in (entry if isinstance(entry, (tuple, list)) else (entry,)):
            if sharding.mesh.shape[axis] > 1 and axis not in axes:
                axes.append(axis)
    if not axes:
        return NamedSharding(sharding.mesh, PartitionSpec())
    return NamedSharding(sharding.mesh, PartitionSpec(tuple(axes)))


def place_global(value, sharding):
    """``value`` (the same full array in every process) as a global array with ``sharding``.

    In one process this is ``jax.device_put``. When the mesh spans several processes a device
    cannot receive data from another process's array, so each process builds only the shards
    on its own devices from its copy of the value (every process holds the same batch, the
    same scalars, and the same initial parameters after a seeded initialization or a
    checkpoint load).
    """
    if getattr(value, "sharding", None) == sharding:
        return value
    if sharding.is_fully_addressable or not getattr(value, "is_fully_addressable", True):
        return jax.device_put(value, sharding)  # one process, or global to global (a reshard)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_step_inputs(args, in_shardings) -> list:
    """A compiled SPMD step's positional groups (a list per group, or one array), each placed
    as its ``in_shardings`` entry says (see :func:`place_global`)."""
    placed = []
    for group, sharding in zip(args, in_shardings):
        if isinstance(sharding, (list, tuple)):
            placed.append([place_global(a, s) for a, s in zip(group, sharding)])
        else:
            placed.append(place_global(group, sharding))
    return placed


class PlacingExecutable:
    """A compiled SPMD step that first places its arguments as the program expects.

    The caller hands in whatever the ``tpu`` tensors hold: batches and constants on one device,
    the RNG key on one device, parameters on one device before their first step. A compiled
    executable accepts only arrays with exactly its input shardings, so each argument is
    ``device_put`` to its sharding; arrays already placed that way (parameters and optimizer
    state after the first step, which the step writes back as global arrays) pass through
    without a copy.
    """

    def __init__(self, compiled, in_shardings):
        self.compiled = compiled
        self.in_shardings = in_shardings

    def __call__(self, *args):
        return self.compiled(*place_step_inputs(args, self.in_shardings))

    def __getattr__(self, name):  # memory_analysis(), cost_analysis(), as_text() ...
        return getattr(self.compiled, name)


def activation_constraint(plan, mesh, model, batch_fakes):
    """The plan's activation rule as a function pinning one traced value (None: no rule).

    The rule sees the micro-batch's ``[batch, seq]`` shape (the first batch input's) and
    classifies intermediates by shape; values it does not name are left to XLA.
    """
    factory = getattr(plan, "activation_rule", None)
    jax_mesh = getattr(mesh, "jax_mesh", mesh)
    context = int(dict(jax_mesh.shape).get("context", 1))
    if factory is None or not batch_fakes:
        if context > 1:
            raise PlanError(f"{getattr(plan, 'name', 'the plan')} has no activation rule, so "
                            f"it cannot split sequences over parallel.context={context}")
        return None
    if context == 1:
        rule = factory(model, tuple(batch_fakes[0].shape))
    elif "context" in inspect.signature(factory).parameters:
        # the sequence dimension split over `context` (tpu_train.compile.context_parallel)
        rule = factory(model, tuple(batch_fakes[0].shape), context=context)
    else:
        raise PlanError(f"{getattr(plan, 'name', 'the plan')} does not support context "
                        f"parallelism; set parallel.context=1")
    if rule is None:
        return None
    cache: dict = {}

    def constrain(value):
        shape = getattr(value, "shape", None)
        if shape is None or not hasattr(value, "dtype"):
            return value
        shape = tuple(shape)
        if shape not in cache:
            spec = rule(shape)
            cache[shape] = None if spec is None else \
                jax.sharding.NamedSharding(jax_mesh, on_mesh(spec, jax_mesh))
        sharding = cache[shape]
        return value if sharding is None else jax.lax.with_sharding_constraint(value, sharding)

    return constrain

