"""SPMD parallelism: the device mesh and sharding plans.

One process drives all of its host's chips; parameters are global ``jax.Array``s with a
``NamedSharding`` over a ``(data, fsdp, tensor)`` mesh, and XLA inserts the collectives when
the whole training step is compiled::

    from tpu_train.models import family_of
    from tpu_train.parallel import build_mesh, sharding_plan
    family = family_of(model)                                        # the model's ModelFamily
    mesh = build_mesh(data=1, fsdp=-1, tensor=2,                     # -1: the rest of the chips
                      split_sizes=family.split_sizes(model.config))
    plan = sharding_plan(family)                                     # from its parameter roles
    shardings = plan.shardings(model.named_parameters(), mesh)       # {name: NamedSharding}
    arrays = plan.place({n: p.detach() for n, p in model.named_parameters()}, mesh)
    arrays["layers.0.attention.wq.weight"].sharding                 # inspect placement

Planning a configuration's per-chip memory and step time before renting the chips is
``tpu_train.planning`` (``tpu-train plan``), a layer above this one.
"""

from tpu_train.compile.spmd import (StepShardings, compute_sharding, flat_storage_sharding,
                                    step_shardings)

from .compiled import place_for_step, place_inputs, storage_bytes_per_device, to_global
from .family_plans import DECODER_ACTIVATIONS, ActivationRule, sharding_plan
from .mesh import (AXES, BATCH_AXES, MeshError, MeshShape, build_mesh, check_divisibility,
                   mesh_from_config, resolve_mesh_shape)
from .plans import PlanError, ShardingPlan, constrain, per_device_bytes

__all__ = [
    "AXES",
    "BATCH_AXES",
    "ActivationRule",
    "DECODER_ACTIVATIONS",
    "MeshError",
    "MeshShape",
    "PlanError",
    "ShardingPlan",
    "StepShardings",
    "build_mesh",
    "check_divisibility",
    "compute_sharding",
    "constrain",
    "flat_storage_sharding",
    "mesh_from_config",
    "per_device_bytes",
    "place_for_step",
    "place_inputs",
    "resolve_mesh_shape",
    "sharding_plan",
    "step_shardings",
    "storage_bytes_per_device",
    "to_global",
]
