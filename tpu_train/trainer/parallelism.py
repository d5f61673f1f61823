"""How one model is spread over the job's devices, from the ``parallel`` config section.

Three layouts, chosen from ``trainer.mode`` and the degrees:

* ``single``: one device (every degree resolves to 1); the step is a one-device program or
  eager PyTorch.
* ``spmd`` (``trainer.mode=compiled``): a ``(data, fsdp, tensor)`` mesh over every device of
  every process; the model's sharding plan places parameters and optimizer state, the batch is
  split over ``data x fsdp``, and the whole step is one program (XLA inserts the collectives).
* ``per_device`` (``trainer.mode=eager`` under a launcher, one process per device): PyTorch's
  own tensor parallelism (DTensor) then FSDP2 ``fully_shard`` over the ``tpu`` process group.

A mismatch between the degrees and the devices, the model's dimensions or the batch is a
:class:`ConfigError` naming the numbers, raised before anything is written.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch
from omegaconf import DictConfig

from tpu_train.parallel.mesh import MeshError, MeshShape, resolve_mesh_shape
from tpu_train.parallel.plans import PlanError

from .config import StepMode
from .errors import ConfigError
from .world import World

LAUNCH_HINT = ("torchrun --nproc-per-node {n} -m tpu_train.cli ... or "
               "python -m tpu_train.launch --nproc {n} -m tpu_train.cli ...")


@dataclasses.dataclass
class Parallelism:
    """The resolved layout; ``mesh``/``plan`` for ``spmd``, ``device_mesh`` for ``per_device``."""

    layout: str
    shape: MeshShape
    world: World
    device: torch.device
    mesh: Any = None
    plan: Any = None
    plan_name: str = "none"
    device_mesh: Any = None

    @property
    def sharded(self) -> bool:
        return self.layout != "single"

    def describe(self) -> str:
        """``mesh data=1 fsdp=8 tensor=1 (8 devices, 1 process), plan llama_plan``."""
        s = self.shape
        processes = f"{self.world.size} process{'es' if self.world.size > 1 else ''}"
        text = (f"mesh data={s.data} fsdp={s.fsdp} tensor={s.tensor} ({s.num_devices} "
                f"device{'s' if s.num_devices > 1 else ''}, {processes})")
        if self.layout == "spmd":
            return f"{text}, SPMD plan {self.plan_name}"
        if self.layout == "per_device":
            return f"{text}, FSDP2 + DTensor per device"
        return text

    # ------------------------------------------------------------------ batches

    def data_parallel_rank(self) -> tuple[int, int]:
        """(rank, size) of this process among the processes that read different rows (eager)."""
        if self.layout != "per_device":
            return 0, 1
        coordinate = self.device_mesh.get_coordinate()
        fsdp_size = self.shape.fsdp
        return coordinate[0] * fsdp_size + coordinate[1], self.shape.batch_shards

    def place_batch(self, micro_batches: Sequence[dict[str, torch.Tensor]], *,
                    to_device: bool = True):
        """This process's part of a global step's micro-batches (host tensors), on the device.

        ``spmd``: the micro-batches joined along dim 0 as one global array per key, of which
        this process transfers only the rows its own devices hold. ``per_device``: each
        micro-batch's rows of this data-parallel rank. ``single``: all of it.
        ``to_device=False`` (not ``spmd``): those rows left on the host, for a consumer that
        transfers them itself (a compiled step hands them to its program as one argument).
        """
        if self.layout == "spmd":
            joined = {k: torch.cat([b[k] for b in micro_batches]) for k in micro_batches[0]}
            return {k: self._global_rows(v) for k, v in joined.items()}
        rank, size = self.data_parallel_rank()
        placed = []
        for batch in micro_batches:
            rows = {k: v.chunk(size)[rank] if size > 1 else v for k, v in batch.items()}
            placed.append({k: v.to(self.device) for k, v in rows.items()} if to_device
                          else rows)
        return placed

    def _global_rows(self, tensor: torch.Tensor):
        import jax

        from tpu_train.device.tensor import host_array, wrap
        from tpu_train.parallel.mesh import BATCH_AXES

        sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(BATCH_AXES))
        rows = process_rows(sharding, tuple(tensor.shape))
        local = host_array(tensor[rows])
        array = jax.make_array_from_process_local_data(sharding, local, tuple(tensor.shape))
        return wrap(array, tensor.dtype, self.device.index or 0, tuple(tensor.shape))


def process_rows(sharding, shape: tuple[int, ...]) -> slice:
    """The contiguous rows of a batch of ``shape`` that this process's devices hold."""
    spans = {(index[0].start or 0, shape[0] if index[0].stop is None else index[0].stop)
             for index in sharding.addressable_devices_indices_map(shape).values()}
    start, stop = min(s for s, _ in spans), max(e for _, e in spans)
    covered = np.zeros(stop - start, dtype=bool)
    for s, e in spans:
        covered[s - start:e - start] = True
    if not covered.all():
        raise ConfigError(f"this process's devices hold non-contiguous rows of the batch {spans}; "
                          "order the mesh so that each process's devices are adjacent")
    return slice(start, stop)


def _degrees(cfg: DictConfig) -> dict[str, int]:
    """``parallel.*``; ``data=-1`` (the default) yields to an explicit ``fsdp=-1`` or
    ``tensor=-1``, so ``parallel.fsdp=-1`` alone means "FSDP over every device"."""
    degrees = {axis: int(cfg.parallel[axis]) for axis in ("data", "fsdp", "tensor")}
    if degrees["data"] == -1 and -1 in (degrees["fsdp"], degrees["tensor"]):
        degrees["data"] = 1
    return degrees


def _resolve(num_devices: int, degrees: dict[str, int], what: str) -> MeshShape:
    try:
        return resolve_mesh_shape(num_devices, **degrees)
    except MeshError as exc:
        raise ConfigError(f"{exc} ({what})") from exc


def _check_batch(cfg: DictConfig, shape: MeshShape) -> None:
    ways = shape.batch_shards
    if cfg.data.batch_size % ways:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} (the global batch) does not split over "
            f"parallel.data * fsdp = {shape.data} * {shape.fsdp} = {ways} ways; make it a "
            f"multiple of {ways}")


def _check_model(model: torch.nn.Module, shape: MeshShape):
    from tpu_train.parallel.model_plans import plan_for_model

    try:
        model_plan = plan_for_model(model)
        model_plan.check(model.config, shape)
    except (MeshError, PlanError) as exc:
        raise ConfigError(str(exc)) from exc
    return model_plan


def setup_parallelism(cfg: DictConfig, model: torch.nn.Module, world: World,
                      device: torch.device) -> Parallelism:
    """Resolve ``cfg.parallel`` for this job; apply the per-device wrappers to ``model``.

    ``model`` is still on the CPU; for ``per_device`` it is sharded (and moved) here, the other
    layouts move it afterwards (:func:`move_model`).
    """
    degrees = _degrees(cfg)
    mode = StepMode(cfg.trainer.mode)
    if mode is StepMode.compiled:
        import jax

        devices = jax.devices()
        shape = _resolve(len(devices), degrees, f"{len(devices)} devices in "
                         f"{world.size} process{'es' if world.size > 1 else ''}")
        if shape.num_devices == 1:
            return Parallelism("single", shape, world, device)
        model_plan = _check_model(model, shape)
        _check_batch(cfg, shape)
        from tpu_train.parallel.mesh import build_mesh

        mesh = build_mesh(shape.data, shape.fsdp, shape.tensor, devices=devices)
        plan = model_plan.make_plan()
        return Parallelism("spmd", shape, world, device, mesh=mesh, plan=plan,
                           plan_name=getattr(plan, "name", model_plan.family))
    if world.size > 1 and device.type != "tpu":
        raise ConfigError(f"{world.size} processes need trainer.device=tpu (one device each); "
                          "got trainer.device=cpu")
    try:
        shape = resolve_mesh_shape(world.size, **degrees)
    except MeshError as exc:
        wanted = int(np.prod([d for d in degrees.values() if d > 0]))
        if world.size == 1 and wanted > 1:
            raise ConfigError(
                f"parallel.data/fsdp/tensor = {degrees['data']}/{degrees['fsdp']}/"
                f"{degrees['tensor']} in trainer.mode=eager shards over {wanted} processes, one "
                f"per device, but this is 1 process; launch {LAUNCH_HINT.format(n=wanted)} "
                "(or use trainer.mode=compiled for one process over all devices)") from exc
        raise ConfigError(f"{exc} (trainer.mode=eager: one device per process, "
                          f"{world.size} processes)") from exc
    if shape.num_devices == 1:
        return Parallelism("single", shape, world, device)
    _check_batch(cfg, shape)
    from tpu_train.parallel.per_device import parallelize_per_device

    try:
        built = parallelize_per_device(model, data=shape.data, fsdp=shape.fsdp,
                                       tensor=shape.tensor)
    except (MeshError, PlanError) as exc:
        raise ConfigError(str(exc)) from exc
    return Parallelism("per_device", shape, world, device, device_mesh=built.mesh)


def local_bytes(tensors) -> int:
    """Bytes this process holds of ``tensors`` (DTensors count their local shard)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def bytes_per_device(parallel: Parallelism, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer) -> int:
    """Largest number of bytes of parameters + optimizer state held by one device."""
    params = list(model.parameters())
    states = [v for state in optimizer.state.values() for v in state.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    if parallel.layout == "spmd":
        from tpu_train.parallel import storage_bytes_per_device

        per_device = storage_bytes_per_device(params + states)
        return max(per_device.values()) if per_device else 0
    return local_bytes(params + states)


def peak_bytes_per_device() -> int | None:
    """The backend's peak bytes in use on this process's busiest device, where it reports it."""
    import jax

    peaks = []
    for d in jax.local_devices():
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None
