"""Which layout (:mod:`tpu_train.trainer.layouts`) spreads the model over the job's devices,
chosen once from ``trainer.mode`` and the ``parallel`` config section:

* one device (every degree resolves to 1): :class:`~tpu_train.trainer.layouts.SingleDevice`;
* ``trainer.mode=compiled`` over several devices: :class:`~tpu_train.trainer.layouts.Spmd`, a
  ``(data, fsdp, expert, context, tensor)`` mesh over every device of every process and the
  sharding plan of the model's family (:func:`tpu_train.models.family_of`, handed down to
  ``parallel``);
* ``trainer.mode=eager`` under a launcher (one process per device):
  :class:`~tpu_train.trainer.layouts.PerDevice`, DTensor TP then FSDP2 ``fully_shard``.

A mismatch between the degrees and the devices, the model's dimensions or the batch is a
:class:`ConfigError` naming the numbers, raised before anything is written.
"""

from __future__ import annotations

import numpy as np
import torch
from omegaconf import DictConfig

from tpu_train.parallel.mesh import MeshError, MeshShape, resolve_mesh_shape
from tpu_train.parallel.plans import PlanError

from .config import StepMode
from .errors import ConfigError
from .layouts import Layout, PerDevice, SingleDevice, Spmd
from .validation import check_context_seq_len
from .world import World

LAUNCH_HINT = ("torchrun --nproc-per-node {n} -m tpu_train.cli ... or "
               "python -m tpu_train.launch --nproc {n} -m tpu_train.cli ...")


def _degrees(cfg: DictConfig) -> dict[str, int]:
    """``parallel.*``; ``data=-1`` (the default) yields to an explicit ``fsdp=-1`` or
    ``tensor=-1``, so ``parallel.fsdp=-1`` alone means "FSDP over every device"."""
    degrees = {axis: int(cfg.parallel[axis])
               for axis in ("data", "fsdp", "expert", "tensor", "context")}
    if degrees["data"] == -1 and -1 in (degrees["fsdp"], degrees["expert"], degrees["tensor"]):
        degrees["data"] = 1
    return degrees


def _resolve(num_devices: int, degrees: dict[str, int], what: str) -> MeshShape:
    try:
        return resolve_mesh_shape(num_devices, **degrees)
    except MeshError as exc:
        raise ConfigError(f"{exc} ({what})") from exc


def _batch_axes(shape: MeshShape) -> str:
    """``data * fsdp = 8 * 1 = 8`` (with ``expert`` where it is above 1)."""
    axes = ("data", "fsdp", "expert") if shape.expert > 1 else ("data", "fsdp")
    return (f"{' * '.join(axes)} = {' * '.join(str(getattr(shape, a)) for a in axes)} = "
            f"{shape.batch_shards}")


def _check_batch(cfg: DictConfig, shape: MeshShape) -> None:
    ways = shape.batch_shards
    if cfg.data.batch_size % ways:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} (the global batch) does not split over "
            f"parallel.{_batch_axes(shape)} ways; make it a multiple of {ways}")


def _family(model: torch.nn.Module):
    from tpu_train.models import family_of

    try:
        return family_of(model)
    except LookupError as exc:
        raise ConfigError(str(exc)) from exc


def _check_model(family, model: torch.nn.Module, shape: MeshShape) -> None:
    from tpu_train.parallel.mesh import check_divisibility

    try:
        check_divisibility(family.split_sizes(model.config), shape)
    except MeshError as exc:
        raise ConfigError(str(exc)) from exc


def _check_window(cfg: DictConfig, model: torch.nn.Module, shape: MeshShape) -> None:
    from tpu_train.compile.context_parallel import ContextParallelError, check_window

    window = getattr(getattr(model, "config", None), "sliding_window", None)
    try:
        check_window(cfg.data.seq_len, shape.context, window)
    except ContextParallelError as exc:
        raise ConfigError(str(exc)) from exc


def setup_parallelism(cfg: DictConfig, model: torch.nn.Module, world: World,
                      device: torch.device) -> Layout:
    """Resolve ``cfg.parallel`` for this job into its layout; apply the per-device wrappers
    to ``model``.

    ``model`` is still on the CPU; for :class:`PerDevice` it is sharded (and moved) here, the
    other layouts move it afterwards (:meth:`Layout.place_model`).
    """
    degrees = _degrees(cfg)
    mode = StepMode(cfg.trainer.mode)
    if mode is StepMode.compiled:
        import jax

        devices = jax.devices()
        shape = _resolve(len(devices), degrees, f"{len(devices)} devices in "
                         f"{world.size} process{'es' if world.size > 1 else ''}")
        if shape.num_devices == 1:
            return SingleDevice(shape, world, device)
        family = _family(model)
        _check_model(family, model, shape)
        _check_batch(cfg, shape)
        from tpu_train.parallel.family_plans import sharding_plan
        from tpu_train.parallel.mesh import build_mesh

        check_context_seq_len(cfg.data.seq_len, shape.context)  # data.seq_len=null resolved
        _check_window(cfg, model, shape)
        mesh = build_mesh(shape.data, shape.fsdp, shape.tensor, devices=devices,
                          expert=shape.expert, context=shape.context)
        try:
            plan = sharding_plan(family)
        except PlanError as exc:
            raise ConfigError(str(exc)) from exc
        return Spmd(shape, world, device, mesh, plan)
    if world.size > 1 and device.type != "tpu":
        raise ConfigError(f"{world.size} processes need trainer.device=tpu (one device each); "
                          "got trainer.device=cpu")
    if degrees["expert"] != 1:
        raise ConfigError(f"parallel.expert={degrees['expert']} (expert parallelism) needs "
                          "trainer.mode=compiled; set parallel.expert=1 for eager steps")
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
        return SingleDevice(shape, world, device)
    _check_batch(cfg, shape)
    from tpu_train.parallel.per_device import parallelize_per_device

    try:
        built = parallelize_per_device(model, _family(model), data=shape.data,
                                       fsdp=shape.fsdp, tensor=shape.tensor)
    except (MeshError, PlanError) as exc:
        raise ConfigError(str(exc)) from exc
    return PerDevice(shape, world, device, built.mesh)


def peak_bytes_per_device() -> int | None:
    """The backend's peak bytes in use on this process's busiest tpu device, where it reports
    it. The devices of the platform tpu_train chose (``TPU_TRAIN_PLATFORM``), not JAX's default
    backend: on a TPU host that would be the chip also where the cpu platform was asked for."""
    from tpu_train.device import runtime

    peaks = []
    for d in runtime.devices():
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None
