"""How one model is spread over the job's devices: one class per layout.

:func:`~tpu_train.trainer.parallelism.setup_parallelism` chooses the layout once, from
``trainer.mode`` and the ``parallel`` degrees; everything that differs between layouts is a
method here, so the rest of the trainer never asks which layout it has:

* :class:`SingleDevice`: one device (every degree resolves to 1); the step is a one-device
  program or eager PyTorch.
* :class:`Spmd` (``trainer.mode=compiled``): a ``(data, fsdp, tensor)`` mesh over every device
  of every process; the model's sharding plan places parameters and optimizer state, the batch
  is split over ``data x fsdp``, and the whole step is one program (XLA inserts the
  collectives).
* :class:`PerDevice` (``trainer.mode=eager`` under a launcher, one process per device):
  PyTorch's own tensor parallelism (DTensor) then FSDP2 ``fully_shard`` over the ``tpu``
  process group.

What a layout does: :meth:`~Layout.place_model`, :meth:`~Layout.place_batch`,
:meth:`~Layout.build_step` (and :meth:`~Layout.place_step`), :meth:`~Layout.full_state` (whole
host copies, every process calls it), :meth:`~Layout.save` and :meth:`~Layout.load`
(checkpoints), :meth:`~Layout.bytes_per_device` and :meth:`~Layout.decodes_on_device`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

from tpu_train.models.lora import adapters_state, has_int8_base, load_adapters_state
from tpu_train.parallel.mesh import MeshShape

from .checkpoint import SHARDED_DIR, refuse_non_finite
from .config import OnNonFinite, StepMode
from .errors import ConfigError
from .state import host_tensor, hyperparameters, restore_hyperparameters
from .step import EagerStep, EagerStepSettings, TrainStep, causal_lm_loss_sum_and_count
from .world import World


class Layout:
    """The behaviour every layout shares; the subclasses change what differs.

    ``shape`` is the resolved mesh shape (all ones for :class:`SingleDevice`), ``world`` this
    process's place in the job, ``device`` this process's device.
    """

    # Does the model live in pieces (a mesh or per-device shards) rather than whole on one device?
    sharded = True
    # Are full_state's tensors host copies that nothing else holds? A checkpoint then takes them
    # as its snapshot instead of copying the whole model and optimizer state a second time.
    full_state_copies = True

    def __init__(self, shape: MeshShape, world: World, device: torch.device):
        self.shape, self.world, self.device = shape, world, device

    def describe(self) -> str:
        """``mesh data=1 fsdp=8 tensor=1 (8 devices, 1 process), SPMD plan llama_plan``."""
        s = self.shape
        processes = f"{self.world.size} process{'es' if self.world.size > 1 else ''}"
        expert = f" expert={s.expert}" if s.expert > 1 else ""
        context = f" context={s.context}" if s.context > 1 else ""
        return (f"mesh data={s.data} fsdp={s.fsdp}{expert} tensor={s.tensor}{context} "
                f"({s.num_devices} device{'s' if s.num_devices > 1 else ''}, {processes})")

    # ------------------------------------------------------------------ model and batches

    def place_model(self, model: torch.nn.Module) -> None:
        """Put the (CPU) model on this process's device."""
        model.to(self.device)

    def data_parallel_rank(self) -> tuple[int, int]:
        """(rank, size) of this process among the processes that read different rows (eager)."""
        return 0, 1

    def rows_per_shard(self, batch_size: int) -> int:
        """Rows of a global batch of ``batch_size`` that one data-parallel shard computes."""
        return batch_size // self.shape.batch_shards if self.sharded else batch_size

    def step_splits(self, trainer, batch_size: int) -> int:
        """Pieces the step that accumulates splits one global batch into: the loader's
        ``trainer.grad_accum_steps`` micro-batches, each cut further into pieces of
        ``trainer.micro_batch_size`` rows per data-parallel shard (a shard with no more rows
        than that runs them at once: on more devices the same job splits less)."""
        accum, micro = trainer.grad_accum_steps, trainer.micro_batch_size
        rows = self.rows_per_shard(batch_size)
        if micro is None or micro >= rows:
            return accum
        if rows % micro:
            divisors = ", ".join(str(d) for d in range(1, rows + 1) if rows % d == 0)
            raise ConfigError(
                f"trainer.micro_batch_size={micro} must divide the {rows} rows each data-parallel "
                f"shard computes per micro-batch (data.batch_size={batch_size} over "
                f"{self.shape.batch_shards if self.sharded else 1} shard(s)); choose one of "
                f"{divisors}, or null")
        return accum * (rows // micro)

    def place_batch(self, batch: dict[str, torch.Tensor], micro_batches: int = 1) -> dict:
        """This process's rows of one step's global ``batch`` (host tensors holding
        ``micro_batches`` micro-batches one after the other): each micro-batch's rows of this
        data-parallel rank, still on the host, for the step that accumulates to split and
        transfer (all of it on one device)."""
        rank, size = self.data_parallel_rank()
        if size == 1:
            return batch
        return {k: _rank_rows(v, micro_batches, rank, size) for k, v in batch.items()}

    # ------------------------------------------------------------------ the step

    def build_step(self, job, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler, loss_fn: Callable = causal_lm_loss_sum_and_count) -> TrainStep:
        """The eager step, or the whole step compiled into one program (on the mesh if any).

        Both check the loss and the gradient norm before updating and apply no update when
        either is not finite (the compiled step inside its program), whatever
        ``trainer.on_nan``: with ``skip`` the loop goes on (and counts the skip), with ``stop``
        it stops. So a non-finite update never reaches the parameters or a checkpoint.
        """
        assert OnNonFinite(job.cfg.trainer.on_nan) in (OnNonFinite.skip, OnNonFinite.stop)
        trainer = job.cfg.trainer
        splits = self.step_splits(trainer, job.cfg.data.batch_size)
        if job.mode is StepMode.compiled:
            # The compiled step accumulates inside its program: it takes the global batch.
            compiled = _compile(job, self, (model, optimizer, scheduler), loss_fn, splits)
            return TrainStep(self, compiled, compiled, splits)
        _, size = self.data_parallel_rank()
        settings = EagerStepSettings(job.precision, trainer.max_grad_norm, splits,
                                     skip_non_finite=True, data_parallel_size=size,
                                     tensor_parallel_size=self.shape.tensor if self.sharded
                                     else 1)
        eager = EagerStep((model, optimizer, scheduler), job.device, settings)
        return TrainStep(self, eager if job.mode is StepMode.eager else _fused(eager), None,
                         splits)

    def place_step(self, step: TrainStep) -> None:
        """Put the step's parameters and optimizer state where it runs (before its first call,
        after a full resume). On one device they already are."""

    # ------------------------------------------------------------------ whole state

    def full_model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with every tensor whole, on the CPU (all processes call it)."""
        return {key: host_tensor(value) for key, value in model.state_dict().items()}

    def full_state(self, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(model state, optimizer state) with whole tensors on the CPU (all processes call it)."""
        state = optimizer.state_dict()
        state["state"] = {index: {k: host_tensor(v) if isinstance(v, torch.Tensor) else v
                                  for k, v in values.items()}
                          for index, values in state["state"].items()}
        return self.full_model_state(model), state

    def load_full_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        model_state: dict, optimizer_state: dict) -> None:
        """Load whole state dicts into ``model``/``optimizer`` in this layout (a model with
        an int8 base: the trained parameters only, as :meth:`save` wrote them)."""
        if has_int8_base(model):
            load_adapters_state(model, model_state)
        else:
            model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    # ------------------------------------------------------------------ checkpoints

    def save(self, run, training_state: dict) -> None:
        """A checkpoint of ``run.step``: one whole copy written by process 0 (every process
        calls this). Only finite parameters and optimizer state are ever written
        (:class:`~tpu_train.trainer.errors.TrainingStopped` otherwise)."""
        model_state, training_state["optimizer"] = self.full_state(run.model, run.optimizer)
        if has_int8_base(run.model):  # the frozen base is rebuilt from its source on resume
            model_state = adapters_state(run.model, model_state)
        run.checkpointer.wait()
        from .checkpoint import non_finite_tensors

        refuse_non_finite(non_finite_tensors(model_state)
                          + non_finite_tensors(training_state["optimizer"], "optimizer"),
                          run.step, run.job.run_dir, run.job.world.is_main)
        owned = frozenset()
        if self.full_state_copies:
            owned = frozenset(id(t) for t in tree_leaves([model_state,
                                                         training_state["optimizer"]["state"]])
                              if isinstance(t, torch.Tensor) and t.is_contiguous())
        run.checkpointer.save(run.step, model_state, training_state, owned)

    def load(self, run, checkpoint: Path, model_state: dict | None,
             training_state: dict) -> None:
        """Restore ``read_checkpoint(checkpoint)``'s states into ``run``'s model, optimizer
        and step, and place the step. ``model_state`` is None for a sharded checkpoint,
        which only the compiled step reads (any mesh, or one device)."""
        step = run.step_fn
        if model_state is not None:
            self.load_full_state(run.model, run.optimizer, model_state,
                                 training_state["optimizer"])
            self.place_step(step)
            return
        from tpu_train.parallel.sharded_checkpoint import load_sharded

        self.place_step(step)
        self._create_optimizer_state(step.compiled)
        load_sharded(checkpoint / SHARDED_DIR, step.compiled)
        restore_hyperparameters(run.optimizer, training_state["param_groups"])

    def _create_optimizer_state(self, compiled) -> None:
        """The optimizer state a sharded checkpoint restores into, created as ``torch.optim``
        would at its first step (on a mesh, placing the step creates it)."""
        for group in compiled.optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    compiled.adapter.ensure_state(p, group)

    # ------------------------------------------------------------------ reports

    def bytes_per_device(self, model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer) -> int:
        """Largest number of bytes of parameters + optimizer state held by one device."""
        return local_bytes(_model_and_optimizer_tensors(model, optimizer))

    def decodes_on_device(self) -> bool:
        """Can a compiled decoder on this process's device read the trained weights themselves:
        they are whole there (one device) or a copy of them (data parallelism in one process)?
        FSDP / tensor-parallel shards and per-device processes decode from a host copy."""
        return True


class SingleDevice(Layout):
    """One device: the model whole on it, every row of the batch."""

    sharded = False


class Spmd(Layout):
    """One program over a mesh of every device of every process (``trainer.mode=compiled``)."""

    def __init__(self, shape: MeshShape, world: World, device: torch.device, mesh, plan):
        super().__init__(shape, world, device)
        self.mesh, self.plan = mesh, plan
        self.plan_name = getattr(plan, "name", "none")

    def describe(self) -> str:
        return f"{super().describe()}, SPMD plan {self.plan_name}"

    def place_batch(self, batch: dict[str, torch.Tensor], micro_batches: int = 1) -> dict:
        """One global array per key of ``batch``, of which this process transfers only the
        rows its own devices hold (the program splits the micro-batches)."""
        return {k: self._global_rows(v) for k, v in batch.items()}

    def _global_rows(self, tensor: torch.Tensor):
        import jax

        from tpu_train.device.tensor import host_array, wrap
        from tpu_train.parallel.mesh import BATCH_AXES

        sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(BATCH_AXES))
        rows = process_rows(sharding, tuple(tensor.shape))
        local = host_array(tensor[rows])
        array = jax.make_array_from_process_local_data(sharding, local, tuple(tensor.shape))
        return wrap(array, tensor.dtype, self.device.index or 0, tuple(tensor.shape))

    def place_step(self, step: TrainStep) -> None:
        from tpu_train.parallel import place_for_step

        place_for_step(step.compiled)

    def save(self, run, training_state: dict) -> None:
        """Sharded when several processes share the mesh: each writes its own shards (no
        process could hold the whole model); else one whole copy, as on one device."""
        if not self.world.distributed:
            super().save(run, training_state)
            return
        import jax.numpy as jnp

        from tpu_train.parallel.sharded_checkpoint import save_sharded, step_state

        run.checkpointer.wait()
        # Every process reduces over the global arrays.
        bad = [name for name, storage in step_state(run.step_fn.compiled).items()
               if jnp.issubdtype(storage.buffer.dtype, jnp.floating)
               and not bool(jnp.all(jnp.isfinite(storage.buffer)))]
        refuse_non_finite(bad, run.step, run.job.run_dir, run.job.world.is_main)
        training_state["param_groups"] = hyperparameters(run.optimizer)
        run.checkpointer.save_sharded(run.step, lambda path: save_sharded(path, run.step_fn.compiled),
                                      training_state, self.world)

    def _create_optimizer_state(self, compiled) -> None:
        """Placing the step on the mesh created it."""

    def bytes_per_device(self, model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer) -> int:
        from tpu_train.parallel import storage_bytes_per_device

        per_device = storage_bytes_per_device(_model_and_optimizer_tensors(model, optimizer))
        return max(per_device.values()) if per_device else 0

    def decodes_on_device(self) -> bool:
        return self.world.size == 1 and self.shape.fsdp == 1 and self.shape.tensor == 1


class PerDevice(Layout):
    """One process per device (``trainer.mode=eager`` under a launcher): DTensor tensor
    parallelism then FSDP2 over ``device_mesh``; the model was sharded (and moved) when the
    layout was chosen."""

    # torch.distributed.checkpoint's full state dicts may hold host tensors the model shares.
    full_state_copies = False

    def __init__(self, shape: MeshShape, world: World, device: torch.device, device_mesh):
        super().__init__(shape, world, device)
        self.device_mesh = device_mesh

    def describe(self) -> str:
        return f"{super().describe()}, FSDP2 + DTensor per device"

    def place_model(self, model: torch.nn.Module) -> None:
        """Already sharded onto the devices by ``parallelize_per_device``."""

    def data_parallel_rank(self) -> tuple[int, int]:
        coordinate = self.device_mesh.get_coordinate()
        return coordinate[0] * self.shape.fsdp + coordinate[1], self.shape.batch_shards

    def full_model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        from tpu_train.parallel.per_device import full_model_state_dict

        # Every process gets the whole state: each validates on its own host copy.
        return full_model_state_dict(model, rank0_only=False)

    def full_state(self, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        from tpu_train.parallel.per_device import full_optimizer_state_dict

        # Process 0 writes the optimizer state.
        return self.full_model_state(model), full_optimizer_state_dict(model, optimizer)

    def load_full_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        model_state: dict, optimizer_state: dict) -> None:
        from tpu_train.parallel.per_device import (load_full_model_state_dict,
                                                    load_full_optimizer_state_dict)

        load_full_model_state_dict(model, model_state)
        load_full_optimizer_state_dict(model, optimizer, optimizer_state)

    def decodes_on_device(self) -> bool:
        return False


def _compile(job, layout: Layout, trained: tuple, loss_fn: Callable, splits: int):
    """``compile_train_step`` of ``trained = (model, optimizer, scheduler)`` for ``layout``,
    accumulating over ``splits`` pieces of each global batch."""
    from tpu_train.compile import CompiledTrainStep, StepSettings

    model, optimizer, scheduler = trained
    trainer = job.cfg.trainer
    settings = StepSettings(
        max_grad_norm=trainer.max_grad_norm, grad_accum_steps=splits,
        mesh=getattr(layout, "mesh", None), plan=getattr(layout, "plan", None),
        compute_dtype=job.precision.compute_dtype, skip_non_finite=True,
        scan_layers=trainer.scan_layers)
    return CompiledTrainStep(model, optimizer, loss_fn, settings, scheduler=scheduler)


def _fused(step: Callable) -> Callable:
    """``step`` in fused eager mode: its ops are recorded and run as regions, each when the
    step reads a value (the finiteness check, the loss) or at the step's end."""
    from tpu_train.device.lazy import eager_mode

    def run(micro_batches):
        with eager_mode("fused"):
            return step(micro_batches)

    return run


def _rank_rows(tensor: torch.Tensor, micro_batches: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank`` of ``size``'s share of each of the consecutive micro-batches in
    ``tensor``, still consecutive."""
    per_micro = tensor.reshape(micro_batches, -1, *tensor.shape[1:])
    return per_micro.chunk(size, dim=1)[rank].reshape(-1, *tensor.shape[1:])


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


def _model_and_optimizer_tensors(model: torch.nn.Module,
                                 optimizer: torch.optim.Optimizer) -> list[Any]:
    states = [v for state in optimizer.state.values() for v in state.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    return list(model.parameters()) + states


def local_bytes(tensors) -> int:
    """Bytes this process holds of ``tensors`` (DTensors count their local shard)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total
