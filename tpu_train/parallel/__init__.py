"""SPMD parallelism: the device mesh and sharding plans.

One process drives all of its host's chips; parameters are global ``jax.Array``s with a
``NamedSharding`` over a ``(data, fsdp, tensor)`` mesh, and XLA inserts the collectives when
the whole training step is compiled::

    from tpu_train.parallel import build_mesh, llama_plan
    mesh = build_mesh(data=1, fsdp=-1, tensor=2, model_config=cfg)   # -1: the rest of the chips
    plan = llama_plan()
    shardings = plan.shardings(model.named_parameters(), mesh)       # {name: NamedSharding}
    arrays = plan.place({n: p.detach() for n, p in model.named_parameters()}, mesh)
    arrays["layers.0.attention.wq.weight"].sharding                 # inspect placement

Planning a configuration's per-chip memory and step time before renting the chips is
``tpu_train.planning`` (``tpu-train plan``), a layer above this one.
"""

from tpu_train.compile.spmd import (StepShardings, compute_sharding, flat_storage_sharding,
                                    step_shardings)

from .compiled import place_for_step, place_inputs, storage_bytes_per_device, to_global
from .llama_plan import LLAMA_ACTIVATIONS, LlamaActivationRule, llama_plan
from .mesh import (AXES, BATCH_AXES, MeshError, MeshShape, build_mesh, check_model_divisibility,
                   mesh_from_config, resolve_mesh_shape)
from .plans import PlanError, ShardingPlan, constrain, per_device_bytes

__all__ = [
    "AXES",
    "BATCH_AXES",
    "LLAMA_ACTIVATIONS",
    "LlamaActivationRule",
    "MeshError",
    "MeshShape",
    "PlanError",
    "ShardingPlan",
    "StepShardings",
    "build_mesh",
    "check_model_divisibility",
    "compute_sharding",
    "constrain",
    "flat_storage_sharding",
    "llama_plan",
    "mesh_from_config",
    "per_device_bytes",
    "place_for_step",
    "place_inputs",
    "resolve_mesh_shape",
    "step_shardings",
    "storage_bytes_per_device",
    "to_global",
]
