"""The per-device world: FSDP2 and DTensor tensor parallelism over the ``tpu`` process group.

In ``trainer.mode=eager`` under a launcher there is one process per device, as on CUDA. The
config's ``parallel.data/fsdp/tensor`` degrees then become a torch ``DeviceMesh`` with the same
axis names as the SPMD mesh (:mod:`.mesh`) and PyTorch's own parallelisms, in torchtitan's
order::

    dist.init_process_group("tpu")                     # under torchrun / tpu_train.launch
    model = Llama(cfg).init_weights(seed=0).to("tpu")
    family = family_of(model)                          # tpu_train.models: its ModelFamily
    par = parallelize_per_device(model, family, data=1, fsdp=-1, tensor=2)
    opt = torch.optim.AdamW(model.parameters())        # after sharding: DTensor parameters
    tokens = global_batch.chunk(par.batch_shards)[par.batch_rank]

1. tensor parallelism: ``parallelize_module`` over ``mesh["tensor"]`` with the plan derived
   from the family's parameter roles (:mod:`.tensor_parallel`), after which the family
   localizes its sizes (attention head counts);
2. FSDP2: ``fully_shard`` on every one of the family's blocks, then on the root, over the
   batch axes.
   With ``data > 1`` that is the 2-D ``mesh["data", "fsdp"]``: HSDP, parameters replicated
   over ``data`` and sharded over ``fsdp``. This keeps the axes' meaning from the SPMD world
   (``data`` = replicated parameters, split batch), where a 1-D ``fully_shard`` over both would
   silently turn ``data`` into more FSDP; HSDP's gradient all-reduce over ``data`` is what DDP
   would do, and one wrapper keeps one kind of parameter (DTensor) for the optimizer and the
   checkpoint helpers below.

Uneven FSDP shards are padded by FSDP2, so unlike the SPMD plan ``fsdp`` need not divide the
model width; ``tensor`` must divide the sizes the family says it splits
(``check_divisibility``).

Checkpointing a sharded model from the trainer: :func:`full_model_state_dict` /
:func:`full_optimizer_state_dict` gather unsharded CPU tensors (to rank 0, or every rank), and
:func:`load_full_model_state_dict` / :func:`load_full_optimizer_state_dict` shard a full state
dict back onto the model and optimizer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .mesh import AXES, MeshError, MeshShape, check_divisibility, resolve_mesh_shape

__all__ = [
    "PerDeviceParallel",
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
    "parallelize_per_device",
    "resolve_per_device_shape",
]


@dataclasses.dataclass(frozen=True)
class PerDeviceParallel:
    """What :func:`parallelize_per_device` built.

    ``mesh`` is the ``(data, fsdp, tensor)`` ``DeviceMesh`` (``None`` in a single process
    without a process group, where nothing is sharded). Ranks that share ``batch_rank`` (the
    ranks of one tensor group) must be fed the same micro-batch: split the global batch into
    ``batch_shards`` and take shard ``batch_rank``.
    """

    shape: MeshShape
    mesh: Any = None

    @property
    def batch_shards(self) -> int:
        return self.shape.batch_shards

    @property
    def batch_rank(self) -> int:
        if self.mesh is None:
            return 0
        return (self.mesh.get_local_rank("data") * self.shape.fsdp
                + self.mesh.get_local_rank("fsdp"))


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _launch_hint(data: Any, fsdp: Any, tensor: Any) -> str | None:
    """The error for degrees > 1 in a single process: say what to launch instead."""
    degrees = {"data": data, "fsdp": fsdp, "tensor": tensor}
    asked = {k: v for k, v in degrees.items() if isinstance(v, int) and v > 1}
    if not asked:
        return None
    n = math.prod(asked.values())
    named = ", ".join(f"parallel.{k}={v}" for k, v in asked.items())
    return (f"{named} in trainer.mode=eager needs {n} processes, one per device: "
            f"torchrun --nproc-per-node {n} -m tpu_train.cli ... or "
            f"python -m tpu_train.launch --nproc {n} -m tpu_train.cli ...")


def resolve_per_device_shape(data: int = -1, fsdp: int = 1, tensor: int = 1, *,
                             split_sizes: Any = None) -> MeshShape:
    """Degrees for one process per device: the product must be the world size.

    A degree > 1 without a process group (or with a world of one) raises :class:`MeshError`
    naming the launch command. ``split_sizes`` (a family's ``split_sizes(config)``) is checked
    for ``tensor`` divisibility.
    """
    world = _world_size()
    if world == 1:
        hint = _launch_hint(data, fsdp, tensor)
        if hint:
            raise MeshError(hint)
    try:
        shape = resolve_mesh_shape(world, data, fsdp, tensor)
    except MeshError as err:
        raise MeshError(f"{err} (trainer.mode=eager: one process per device, world size "
                        f"{world})") from None
    if split_sizes is not None:
        # FSDP2 pads uneven shards, so only the tensor split constrains the model.
        check_divisibility(split_sizes, MeshShape(shape.data, 1, shape.tensor))
    return shape


def parallelize_per_device(model: nn.Module, family: Any, *, data: int, fsdp: int, tensor: int,
                           device_type: str = "tpu", mp_policy=None,
                           reshard_after_forward: bool = True) -> PerDeviceParallel:
    """Apply tensor parallelism, then FSDP2, to ``model`` in place (see the module docstring).

    ``family``: the model's :class:`tpu_train.models.ModelFamily` (its parameter roles,
    blocks, split sizes and ``localize_tensor_parallel``).

    ``model`` must be materialized (not on the meta device): weights are initialized or loaded
    before sharding. Parameters not yet on ``device_type`` are moved there first. Create the
    optimizer afterwards: sharding replaces the parameters with DTensors.
    """
    shape = resolve_per_device_shape(data, fsdp, tensor,
                                     split_sizes=family.split_sizes(model.config))
    if _world_size() == 1:
        return PerDeviceParallel(shape)
    if any(p.is_meta for p in model.parameters()):
        raise MeshError("parallelize_per_device needs materialized weights; the model is on "
                        "the meta device (initialize or load it first)")
    if any(p.device.type != device_type for p in model.parameters()):
        model.to(device_type)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Expert and context parallelism are SPMD-only (the config checks refuse them in eager
    # mode): the per-device mesh has no such axes.
    mesh = init_device_mesh(device_type, (shape.data, shape.fsdp, shape.tensor),
                            mesh_dim_names=("data", "fsdp", "tensor"))
    if shape.tensor > 1:
        from .tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(family, model, mesh["tensor"])
    if shape.batch_shards > 1:
        dp_mesh = mesh["data", "fsdp"] if shape.data > 1 else mesh["fsdp"]
        kwargs = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                      mp_policy=mp_policy or MixedPrecisionPolicy())
        for block in family.blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return PerDeviceParallel(shape, mesh)


# --------------------------------------------------------------------------- checkpointing

def _options(full_state_dict: bool = True, **kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full_state_dict, **kwargs)


def _full_cpu(value):
    """Unshard DTensors and copy to the CPU, one tensor at a time (nested dicts and lists)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _full_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_full_cpu(v) for v in value)
    return value


def _containers_copied(value):
    """A copy of the dicts and lists of a state dict, sharing its tensors: torch's full state
    dict loading replaces entries of the dict it is given with sharded DTensors, and the
    caller's dict must stay a full CPU checkpoint (e.g. to load a second model from it)."""
    if isinstance(value, dict):
        return {k: _containers_copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_containers_copied(v) for v in value)
    return value


def full_model_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict:
    """The unsharded model state dict on the CPU; with ``rank0_only`` other ranks get ``{}``.

    Every rank must call it (the gathers are collectives). ``rank0_only=False`` gives every
    rank a full copy, still gathering one tensor at a time so device memory never holds more
    than one unsharded tensor.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if rank0_only:
        return get_model_state_dict(model, options=_options(cpu_offload=True))
    sharded = get_model_state_dict(model, options=_options(False))
    return _full_cpu(sharded)


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                              rank0_only: bool = True) -> dict:
    """The unsharded optimizer state dict (keyed by parameter names) on the CPU."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if rank0_only:
        return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    sharded = get_optimizer_state_dict(model, optimizer, options=_options(False))
    return _full_cpu(sharded)


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    shape: tuple
    dtype: torch.dtype


def _skeleton(value):
    if isinstance(value, torch.Tensor):
        return _TensorSpec(tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _skeleton(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_skeleton(v) for v in value)
    return value


def _filled(skeleton, value):
    """Rank 0's tensors broadcast into ``skeleton`` one at a time (CPU tensors: the tpu group
    moves host tensors too, and no device memory is spent on a copy of the whole model)."""
    if isinstance(skeleton, _TensorSpec):
        tensor = value.detach().cpu().contiguous() if value is not None else \
            torch.empty(skeleton.shape, dtype=skeleton.dtype)
        dist.broadcast(tensor, src=0)
        return tensor
    if isinstance(skeleton, dict):
        return {k: _filled(v, value[k] if value is not None else None)
                for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_filled(s, value[i] if value is not None else None)
                              for i, s in enumerate(skeleton))
    return skeleton


def _from_rank0(state_dict: dict) -> dict:
    """Rank 0's full state dict on every rank.

    Not torch's ``broadcast_from_rank0`` option: it picks the broadcast device from the
    group's registered backend devices (``pg._device_types``), which a Python ProcessGroup
    like ``tpu`` does not have (IndexError). Each rank briefly holds a full CPU copy.
    """
    rank0 = dist.get_rank() == 0
    holder = [_skeleton(state_dict) if rank0 else None]
    dist.broadcast_object_list(holder, src=0)
    return _filled(holder[0], state_dict if rank0 else None)


def load_full_model_state_dict(model: nn.Module, state_dict: dict, *,
                               from_rank0: bool = False) -> None:
    """Shard a full (CPU) model state dict onto ``model``; with ``from_rank0`` only rank 0's
    ``state_dict`` is read (others may pass ``{}``, e.g. only rank 0 read the file)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    state_dict = _from_rank0(state_dict) if from_rank0 else _containers_copied(state_dict)
    set_model_state_dict(model, state_dict, options=_options())


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                   state_dict: dict, *, from_rank0: bool = False) -> None:
    """Shard a full optimizer state dict (from :func:`full_optimizer_state_dict`) back on."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state_dict = _from_rank0(state_dict) if from_rank0 else _containers_copied(state_dict)
    set_optimizer_state_dict(model, optimizer, state_dict, options=_options())
