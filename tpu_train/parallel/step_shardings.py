"""Shardings for the inputs and outputs of a compiled training step.

A compiled step takes lists of parameters, optimizer-state tensors, constants (buffers such as
RoPE tables) and batch tensors, and returns the new parameters and state. Under SPMD its
``jax.jit`` needs an ``in_shardings``/``out_shardings`` entry for each; this module derives them
from a :class:`~tpu_train.parallel.plans.ShardingPlan` so a step compiler only has to say which
parameter each state tensor belongs to:

* parameter ``i`` → the plan's sharding of its name;
* a state tensor shaped like its parameter (AdamW moments) → the parameter's sharding; any
  other state (step counts, scalars) → replicated;
* constants → replicated (small, read-only);
* batch tensors → leading (batch) dimension split over ``(data, fsdp)``, the rest replicated.

Arrays must keep their natural shapes: a flattened ``[out * in]`` buffer cannot carry a
``[tensor, fsdp]`` tiling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.sharding import NamedSharding, PartitionSpec

from .mesh import BATCH_AXES
from .plans import PlanError, ShardingPlan

__all__ = ["StepShardings", "compute_sharding", "flat_storage_sharding", "step_shardings"]


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


def step_shardings(plan: ShardingPlan, mesh, *, param_names: Sequence[str],
                   param_shapes: Sequence[Sequence[int]],
                   state_owners: Sequence[int | None] = (),
                   state_shapes: Sequence[Sequence[int]] = (),
                   num_consts: int = 0,
                   batch_shapes: Sequence[Sequence[int]] = ()) -> StepShardings:
    """Shardings of a step's parameters, optimizer state, constants and batch on ``mesh``.

    ``state_owners[j]`` is the index (into ``param_names``) of the parameter state tensor
    ``j`` belongs to, or ``None``. Raises :class:`PlanError` for a batch whose leading dimension
    does not split over ``data * fsdp``, or lists of mismatched lengths.
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
    for axis in BATCH_AXES:
        ways *= mesh.shape[axis]
    batch = []
    for i, shape in enumerate(batch_shapes):
        if not shape:
            batch.append(replicated)
            continue
        if shape[0] % ways:
            raise PlanError(
                f"batch tensor {i} has leading dimension {shape[0]}, which does not split over "
                f"data * fsdp = {ways} devices; make the (micro-)batch a multiple of {ways}")
        batch.append(NamedSharding(mesh, PartitionSpec(BATCH_AXES)))
    return StepShardings(params, tuple(states), (replicated,) * num_consts, tuple(batch),
                         replicated, tuple(compute_sharding(p) for p in params))


def compute_sharding(sharding: NamedSharding) -> NamedSharding:
    """The layout a parameter stored with ``sharding`` is used in: the batch axes removed.

    FSDP stores a weight split over ``fsdp`` but computes with it whole (all-gathered) on a
    batch split over ``fsdp``. Left to XLA's sharding propagation, a weight split on its
    *contraction* dimension (the Llama plan's fallback layout, FSDP on ``in``) makes XLA
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
        kept = tuple(a for a in axes if a not in BATCH_AXES)
        return None if not kept else (kept[0] if len(kept) == 1 else kept)

    return NamedSharding(sharding.mesh,
                         PartitionSpec(*(without_batch_axes(e) for e in sharding.spec)))


def flat_storage_sharding(sharding: NamedSharding) -> NamedSharding:
    """The sharding of a tensor's *flat* storage buffer that splits it as many ways as
    ``sharding`` splits the tensor.

    The ``tpu`` device keeps every storage as one flat buffer, and a flat array can only be
    cut into contiguous blocks, so the plan's tiling of ``[out, in]`` (say ``(tensor, fsdp)``)
    cannot always be the buffer's own layout (it is when every split is on the leading dimension,
    as in the Llama plan). The buffer is split in row-major blocks over
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
