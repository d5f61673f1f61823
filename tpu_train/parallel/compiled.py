"""Placing a compiled PyTorch step's tensors on a mesh before its first call.

``compile_train_step(..., mesh=mesh, plan=plan)`` compiles one SPMD program whose parameter
and optimizer-state inputs are flat global arrays (see
:func:`~tpu_train.parallel.flat_storage_sharding`). The step places whatever it is given on its
first call and writes global arrays back, so it works without this module; but the arrays'
placement is part of the compile cache's key, so the second call would compile once more.
:func:`place_for_step` places everything up front instead — the optimizer state included,
which ``torch.optim`` only creates at the first step — so the step compiles once.
"""

from __future__ import annotations

from typing import Any

import jax

from tpu_train.compile.spmd import (PlanError, flat_storage_sharding, place_global,
                                    place_step_inputs)
from tpu_train.device import TpuTensor, owns_whole_storage, storage_of

__all__ = ["place_for_step", "place_inputs", "storage_bytes_per_device", "to_global"]


def place_for_step(step: Any, mesh=None, plan=None) -> dict[str, Any]:
    """Make ``step``'s parameters, optimizer state and buffers global arrays on the mesh.

    Args:
        step: a ``CompiledTrainStep`` (``compile_train_step``'s result).
        mesh, plan: default to the step's own ``mesh`` and ``plan``.

    Each optimized parameter's storage (and its AdamW moments') is split per the plan, in the
    flat layout the program expects; other storages (buffers, frozen parameters, views that do
    not own their storage, shared storages) are replicated. Returns ``{parameter name:
    NamedSharding}`` of the plan, for inspection.
    """
    mesh = mesh if mesh is not None else step.settings.mesh
    plan = plan if plan is not None else step.settings.plan
    if mesh is None or plan is None:
        raise ValueError("place_for_step needs a mesh and a plan (from the step or as arguments)")
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    names = {id(p): n for n, p in step.model.named_parameters(remove_duplicate=False)}
    targets: dict[int, tuple[Any, Any]] = {}  # id(storage) -> (storage, flat sharding)
    users: dict[int, set] = {}  # id(storage) -> ids of the tensors that read it
    plan_shardings: dict[str, Any] = {}

    def claim(tensor, sharding):
        storage = storage_of(tensor)
        users.setdefault(id(storage), set()).add(id(tensor))
        whole = owns_whole_storage(tensor)
        targets.setdefault(id(storage), (storage, sharding if whole else replicated))

    for group in step.optimizer.param_groups:
        keys = step.adapter.state_keys_for(group)
        for p in group["params"]:
            if not p.requires_grad:
                continue
            name = names.get(id(p))
            if name is None:
                raise PlanError("an optimized parameter is not a parameter of the model; the "
                                "plan names parameters by their module path")
            sharding = plan.sharding_for(name, tuple(p.shape), mesh)
            plan_shardings[name] = sharding
            flat = flat_storage_sharding(sharding)
            claim(p, flat)
            step.adapter.ensure_state(p, group)
            for key in keys:
                state = step.optimizer.state[p][key]
                claim(state, flat if tuple(state.shape) == tuple(p.shape) else replicated)
    for t in list(step.model.parameters()) + list(step.model.buffers()):
        if isinstance(t, TpuTensor):
            claim(t, replicated)
    for key, (storage, sharding) in targets.items():
        if len(users[key]) > 1:  # tied weights: the step passes them as copies, not split buffers
            sharding = replicated
        storage.buffer = to_global(storage.buffer, sharding)
    return plan_shardings


# The compile layer places a step's inputs itself; these names are the parallel layer's API
# for placing arrays outside a step (parameters before the first call, checkpoint restores).
to_global = place_global
place_inputs = place_step_inputs


def storage_bytes_per_device(tensors) -> dict[Any, int]:
    """Bytes each device holds of the storages of ``tensors`` (each storage counted once)."""
    seen, totals = set(), {}
    for t in tensors:
        storage = storage_of(t)
        if id(storage) in seen:
            continue
        seen.add(id(storage))
        for shard in storage.buffer.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return totals
