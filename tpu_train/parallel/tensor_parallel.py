"""Tensor parallelism of a model family for the per-device world (DTensor).

The per-device counterpart of :mod:`.family_plans` (which gives SPMD ``PartitionSpec``s), from
the same table of parameter roles: a ``parallelize_module`` plan with torch's
``ColwiseParallel`` / ``RowwiseParallel`` styles, Megatron-style, as torchtitan applies them:

==============  ===========================================================================
role            style of the module holding the weight (and why)
==============  ===========================================================================
``embedding``   Rowwise: vocabulary rows split, output all-reduced to a replicated residual
                stream (kept whole when there is no ``output`` module: tied embeddings)
``column``      Colwise: each rank computes its share of the heads or hidden units
``row``         Rowwise: partial sums, all-reduced
``output``      Colwise with a replicated (all-gathered) result, so an ordinary
                ``cross_entropy`` on the logits works
``replicated``  not planned: replicated plain parameters
==============  ===========================================================================

No sequence parallelism: it would split the residual stream on the sequence dimension and so
require every batch's sequence length to divide ``tensor``; norms and the residual stream stay
replicated over ``tensor`` instead, as in the SPMD plan. After the split the family's
``localize_tensor_parallel(model, tensor)`` tells its modules their local sizes (attention
head counts), so the model file itself stays free of parallel code.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from .plans import PlanError

__all__ = ["apply_tensor_parallel", "tensor_parallel_plan"]


def _module_roles(family: Any, model: nn.Module) -> dict[str, str]:
    """``{module path: role}`` of the modules whose ``weight`` has a role."""
    roles = {}
    for name, _ in model.named_parameters():
        path, _, leaf = name.rpartition(".")
        role = family.role_of(name)
        if leaf == "weight" and role is not None:
            roles[path] = getattr(role, "value", role)
    return roles


def tensor_parallel_plan(family: Any, model: nn.Module) -> dict:
    """The ``parallelize_module`` plan (module path -> style) of ``model``, from ``family``'s
    parameter roles."""
    roles = _module_roles(family, model)
    # With tied embeddings the logits are F.linear(h, embedding.weight) with a plain h: a
    # vocabulary-sharded DTensor weight cannot meet it, so the table stays whole.
    has_output = "output" in roles.values()
    styles = {
        "embedding": (lambda: RowwiseParallel(input_layouts=Replicate())) if has_output else None,
        "column": ColwiseParallel,
        "row": RowwiseParallel,
        "output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "replicated": None,
    }
    plan = {}
    for path, role in roles.items():
        if role not in styles:
            raise PlanError(f"family {family.name}: module {path!r} has role {role!r}, which "
                            f"per-device tensor parallelism cannot split; roles: "
                            f"{', '.join(styles)}")
        if styles[role] is not None:
            plan[path] = styles[role]()
    return plan


def apply_tensor_parallel(family: Any, model: nn.Module, tp_mesh) -> None:
    """Shard ``model`` over the 1-D ``tp_mesh`` and tell it its local sizes.

    Divisibility was checked against the family's split sizes before sharding.
    """
    parallelize_module(model, tp_mesh, tensor_parallel_plan(family, model))
    if family.localize_tensor_parallel is not None:
        family.localize_tensor_parallel(model, tp_mesh.size())
