"""``compile_train_step``: a whole PyTorch training step as one donated XLA program.

The user's objects stay the source of truth. Each call reads the module's parameters and
buffers, the optimizer's ``param_groups`` and ``state``, runs one compiled program
``(params, opt state, constants, batch, host scalars) -> (new params, new state, metrics)``
and swaps the results into the existing ``tpu`` tensors' storages, so ``model.state_dict()``,
``optimizer.state_dict()``, eager code and checkpoints see the update. The scheduler (if
any) is stepped after the update, as in an eager loop, and its learning rate reaches the
program as an input: lr schedules never recompile.

``skip_non_finite=True`` checks the loss and the gradient norm inside the program and applies
the update only when both are finite (the old parameters and state are kept otherwise, in
the same program). A skipped step does not advance the optimizer's step count (as an eager
loop that skips ``optimizer.step()``); the scheduler still steps, so the lr stays aligned with
the data. The result then has a ``finite`` flag (1.0 or 0.0) in the metrics vector with the
loss, so a call never waits for the device: the host's step counts are advanced when the
program is dispatched and put back for a skipped update when the flag is next needed
(:meth:`CompiledTrainStep.settle`: the next call, the optimizer's ``state_dict()``,
``load_state_dict()`` or ``step()``), by which time a loop that read the loss has it here.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable

import jax
import numpy as np
import torch
from torch.utils._pytree import tree_map

from tpu_train.compile import cache as cache_mod
from tpu_train.compile import context_parallel, stacked_layers
from tpu_train.compile.call_plan import CallPlan, StackedCall, donatable, structure_generation
from tpu_train.compile.functional_optim import adapter_for
from tpu_train.compile.lowering import (ScalarsAhead, StepInputs, batch_structure,
                                        collect_step_inputs, flatten_batch, host_scalars,
                                        lower_collected, step_autocast_dtype)
from tpu_train.compile.program import FINITE, METRICS, compile_program, natural_layout
from tpu_train.compile.step_settings import StepSettings
from tpu_train.device import rng, runtime
from tpu_train.device.storage import Storage, shape_whole
from tpu_train.device.tensor import (TpuTensor, from_host_whole, host_array, new_tensor,
                                     owns_whole_storage, storage_of, wrap, write_elements)
from tpu_train.ops import matmul as matmul_mod

__all__ = ["compile_train_step", "CompiledTrainStep"]


def _placement(array) -> Any:
    sharding = getattr(array, "sharding", None)
    return sharding


def _on_device(array, device):
    """What the program is lowered with for one batch argument: a host array stands for
    itself on ``device`` (the executable transfers it there)."""
    if isinstance(array, np.ndarray):
        return jax.ShapeDtypeStruct(array.shape, array.dtype,
                                    sharding=jax.sharding.SingleDeviceSharding(device))
    return array


def _step_arrays(tensors, whole_flags, natural: bool) -> list:
    """The program's parameter or state arguments: each tensor's storage buffer where the
    tensor is its whole storage (donated), else a copy of its elements; flat, or in the
    tensors' own shapes (:func:`tpu_train.compile.program.natural_layout`)."""
    if natural:
        return [storage_of(t).shaped(tuple(t.shape)) if w else t.jax_value()
                for t, w in zip(tensors, whole_flags)]
    return [storage_of(t).buffer if w else t.jax_value().reshape(-1)
            for t, w in zip(tensors, whole_flags)]


def _metric_tensors(metrics, own_norm, grad_norm_dtype: torch.dtype, index: int,
                    finite: bool) -> dict[str, TpuTensor]:
    """The step's loss, gradient norm and lr (and with ``finite`` its finiteness flag) as
    0-dim tensors over the program's metrics vector (:data:`tpu_train.compile.program.METRICS`):
    one storage, one transfer to read. ``own_norm``: the gradient norm the program also
    returned in its own dtype (not float32), or None."""
    storage = Storage(metrics, torch.float32, index, metrics.nbytes)
    out = {name: new_tensor(storage, (), (), position) for name, position in METRICS.items()}
    if finite:
        out["finite"] = new_tensor(storage, (), (), FINITE)
    if own_norm is not None:
        out["grad_norm"] = wrap(own_norm, grad_norm_dtype, index, shape=())
    return out


def read_finite(metrics) -> bool:
    """The finiteness flag of a step's metrics vector (a wait for the device, unless its
    values are on the host already: a loop that read the step's loss has them)."""
    return bool(np.asarray(metrics)[FINITE])


def _settle_hook(step_ref):
    """An optimizer hook (any arguments) that settles the compiled step's step counts."""
    def hook(*_):
        step = step_ref()
        if step is not None:
            step.settle()
    return hook


class CompiledTrainStep:
    """The callable returned by :func:`compile_train_step`: ``model``, ``optimizer`` and
    ``loss_fn`` stepped under ``settings`` (a :class:`StepSettings`); ``scheduler`` is stepped
    after each call; ``name`` names the step in compile logs."""

    def __init__(self, model, optimizer, loss_fn, settings: StepSettings = StepSettings(), *,
                 scheduler=None, name=None):
        self.settings = settings
        self.model = model
        self.optimizer = optimizer
        shards = context_parallel.context_degree(settings.mesh)
        self.loss_fn = loss_fn if shards == 1 else context_parallel.zigzag_loss(loss_fn, shards)
        self.scheduler = scheduler
        self.adapter = adapter_for(optimizer)
        self.cache = cache_mod.CompileCache(
            name or f"train step of {type(model).__name__}", warn_after=settings.warn_after)
        self._names: dict[int, str] = {}
        self._call_plan: CallPlan | None = None
        self._batch_structure = None  # the latest batch's (lowering.batch_structure)
        # (metrics, [(group, step count)]) of a call whose update may have been skipped:
        # its counts were advanced, and go back in settle() if the flag says so.
        self._unsettled: tuple | None = None
        self._scalars_ahead = ScalarsAhead()
        self._stacked: StackedCall | None = None  # the latest call's, where it had stacks
        if settings.skip_non_finite:
            # Whatever reads, replaces or advances the counts on the optimizer settles first.
            hook = _settle_hook(weakref.ref(self))
            optimizer.register_state_dict_pre_hook(hook)
            optimizer.register_load_state_dict_pre_hook(hook)
            optimizer.register_step_pre_hook(hook)

    # ------------------------------------------------------------------ reading user state

    def _name_of(self, tensor) -> str:
        name = self._names.get(id(tensor))
        if name is None:
            self._names = {id(t): n for n, t in self.model.named_parameters(remove_duplicate=False)}
            self._names.update({id(t): n for n, t in self.model.named_buffers(remove_duplicate=False)})
            name = self._names.get(id(tensor), f"<unnamed tensor {id(tensor):x}>")
        return name

    def _collect(self, batch) -> StepInputs:
        return collect_step_inputs(self.model, self.optimizer, self.adapter, batch,
                                   self._name_of)

    def _device_index(self, st: StepInputs) -> int:
        indices = {t.device.index for t in st.params + st.states + st.consts
                   if isinstance(t, TpuTensor)}
        indices |= {t.device.index for t in st.batch_leaves if isinstance(t, TpuTensor)}
        for t in st.params + st.states + st.consts:
            if not isinstance(t, TpuTensor):
                raise TypeError(
                    f'"{self._name_of(t)}" is on {t.device}: move the model (and create the '
                    "optimizer) on the tpu device before compile_train_step")
        if len(indices) != 1:
            raise RuntimeError(f"the step's tensors sit on several tpu devices {sorted(indices)}")
        return indices.pop()

    # ------------------------------------------------------------------ signature

    def _settings(self, st: StepInputs, whole: tuple,
                  autocast_dtype: torch.dtype | None) -> tuple:
        own = self.settings
        settings = [("model.training", self.model.training),
                    ("max_grad_norm", own.max_grad_norm),
                    ("grad_accum_steps", own.grad_accum_steps),
                    ("donate", own.donate),
                    ("scan_layers", own.scan_layers),
                    ("autodiff", own.autodiff),
                    ("skip_non_finite", own.skip_non_finite),
                    ("optimizer param group sizes", tuple(st.group_sizes)),
                    ("params that own their storage", whole),
                    ("autocast dtype", autocast_dtype),
                    ("compute dtype", own.compute_dtype),
                    # The level every float32 dot is traced with: a changed
                    # torch.set_float32_matmul_precision must not reuse a program.
                    ("matmul precision", matmul_mod.get_matmul_precision())]
        for i, group in enumerate(self.optimizer.param_groups):
            for key, value in self.adapter.static_settings(group):
                settings.append((f"optimizer.param_groups[{i}][{key!r}]", value))
        return tuple(settings)

    @staticmethod
    def _specs(names, tensors, arrays) -> tuple:
        specs = []
        for name, t, a in zip(names, tensors, arrays):
            shape, stored = tuple(t.shape), tuple(a.shape)
            specs.append(cache_mod.InputSpec(name, shape, t.dtype, _placement(a),
                                             None if stored == shape else stored))
        return tuple(specs)

    @classmethod
    def _tensor_specs(cls, st: StepInputs) -> tuple:
        """The signature's fixed part: every parameter, state and constant as the program
        sees it (its placement is its storage's)."""
        def specs(names, tensors):
            return tuple(cache_mod.InputSpec(name, tuple(t.shape), t.dtype,
                                             storage_of(t).sharding)
                         for name, t in zip(names, tensors))

        return (specs([f'param "{n}"' for n in st.param_names], st.params)
                + specs(st.state_names, st.states)
                + specs([f'"{n}"' for n in st.const_names], st.consts))

    # ------------------------------------------------------------------ the call

    def _plan(self, batch) -> tuple[CallPlan, list, list, Any]:
        """The call plan (collected again where the last one no longer holds) and this call's
        batch leaves, their names and tree spec."""
        leaves, names, spec = flatten_batch(batch, self._batch_structure)
        self._batch_structure = batch_structure(batch, names, spec)
        plan = self._call_plan
        if plan is None or not plan.holds(self, leaves):
            generation = structure_generation()
            st = self._collect(batch)
            if not st.params:
                raise ValueError("the optimizer holds no parameter that requires grad")
            index = self._device_index(st)
            plan = self._call_plan = CallPlan.collect(self, st, index, donatable(st),
                                                      self._tensor_specs(st), generation)
        return plan, leaves, names, spec

    def _param_and_state_arrays(self, plan: CallPlan, natural: bool) -> tuple[list, list]:
        st, n_params = plan.inputs, len(plan.inputs.params)
        arrays = plan.reused_arrays()
        if arrays is not None:
            return arrays[:n_params], arrays[n_params:]
        whole = plan.whole
        if natural:  # every reshape to the natural shapes in one program, not one per shape
            tensors = [t for t, w in zip(st.params + st.states, whole) if w]
            shape_whole([storage_of(t) for t in tensors], [tuple(t.shape) for t in tensors])
        return (_step_arrays(st.params, whole[:n_params], natural),
                _step_arrays(st.states, whole[n_params:], natural))

    def _stacked_arguments(self, plan: CallPlan, stacking, device, arrays: tuple,
                           stacked: tuple | None) -> tuple[list, list]:
        """The param and state arguments of a program with ``stacking`` (None: per tensor):
        the latest call's stacked outputs where they stand for the storages (``stacked``),
        else the storages' arrays (``arrays``, read now if not yet) with the slots stacked."""
        if stacked is not None and self._stacked.stacking == stacking:
            return stacked
        if arrays[0] is None:
            arrays = self._param_and_state_arrays(plan, natural_layout(device.platform))
        if stacking is None:
            return arrays
        return (stacked_layers.stack_slots(arrays[0], stacking.param_slots,
                                           stacking.loose_params),
                stacked_layers.stack_slots(arrays[1], stacking.state_slots,
                                           stacking.loose_states))

    def _batch_arrays(self, names, leaves) -> list:
        arrays = []
        accum = self.settings.grad_accum_steps
        for name, t in zip(names, leaves):
            if t.dim() == 0 or t.shape[0] % accum:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}: with grad_accum_steps="
                    f"{accum} every batch tensor's first dim must be a multiple "
                    "of it (micro-batches are consecutive slices along dim 0)")
            # A host tensor goes to the executable as a NumPy array: its own transfer, with
            # the other host arguments, costs less host time than a device_put before.
            arrays.append(self._batch_array(t) if isinstance(t, TpuTensor) else host_array(t))
        return arrays

    def _batch_array(self, tensor: TpuTensor):
        """A tpu batch tensor's argument: the whole of its storage goes in as it is stored
        (as ``.to("tpu")`` leaves it: flat on the CPU client, in its shape on a TPU) and the
        program reshapes a flat one, where reading it in its shape would run a reshape program
        each call; a part of a larger storage, or any tensor of an SPMD step (placed by the
        layout), is read as a view."""
        if self.settings.mesh is None and owns_whole_storage(tensor):
            return storage_of(tensor).as_stored()
        return tensor.jax_value()

    def _prepared(self, batch) -> tuple:
        """What a call with ``batch`` runs: ``(plan, device, argument lists, signature,
        build)``, where ``build(stages, compile=True)`` makes the program for ``signature``."""
        self.settle()  # the last call's step counts, before this one reads them
        plan, leaves, names, spec = self._plan(batch)
        index, whole = plan.device_index, plan.whole
        device = runtime.jax_device(index)
        mesh = self.settings.mesh
        natural = mesh is None and natural_layout(device.platform)
        # A stacked layer's storage is read (and its layer made) only where the latest
        # call's stacked outputs no longer stand for it.
        stacked = None if self._stacked is None else self._stacked.reusable(plan)
        param_arrays, state_arrays = (None, None) if stacked is not None \
            else self._param_and_state_arrays(plan, natural)
        const_arrays = plan.const_arrays()
        batch_arrays = self._batch_arrays(names, leaves)
        autocast_dtype = step_autocast_dtype(self.settings.autocast_dtype)
        signature = plan.signature(self._specs(names, leaves, batch_arrays),
                                   self._settings(plan.inputs, whole, autocast_dtype))
        scalars, steps = host_scalars(self.optimizer, self.adapter)

        def build(stages, compile: bool = True):
            st = dataclasses.replace(plan.inputs, batch_leaves=leaves, batch_names=names,
                                     batch_spec=spec)
            values = {"params": param_arrays, "states": state_arrays, "consts": const_arrays,
                      "batch": [_on_device(a, device) for a in batch_arrays], "whole": whole}
            return lower_collected(self, st, scalars, stages, values=values, device=device,
                                   mesh=mesh, plan=self.settings.plan,
                                   autocast_dtype=autocast_dtype,
                                   runtime_options=True, compile=compile)

        arguments = (param_arrays, state_arrays, const_arrays, batch_arrays,
                     self._scalars_ahead.take(scalars), steps, stacked)
        return plan, device, arguments, signature, build

    def put_batch(self, batch):
        """``batch`` with its host tensors on the device the step runs on, for a later call.

        A loop that puts the next batch while this step's program runs has it resident when
        the call comes: a host tensor is an argument the executable transfers at the launch,
        and on a TPU a program waits for every such transfer before it starts. The program
        for device batches is not the one for host batches (a loop keeps to one kind). A step
        over a mesh returns ``batch`` as it is: its layout places batches on the mesh."""
        if self.settings.mesh is not None:
            return batch
        index = next(iter(self.model.parameters())).device.index

        def put(value):
            if isinstance(value, torch.Tensor) and not isinstance(value, TpuTensor):
                return from_host_whole(value, index)  # .to()'s transfer without its empty + copy_
            return value

        return tree_map(put, batch)

    def compile_ahead(self, batch) -> bool:
        """Start compiling the program for batches like ``batch`` before the first call.

        Tracing and lowering run now, on this thread (they read the model and optimizer);
        XLA's compile runs on a thread of its own while this one goes on (a validation pass,
        say). Nothing is updated or run: missing optimizer state is created, as the first
        call would. The first call with a batch of the same shapes and unchanged settings
        waits for the compile and raises its error, if any (``ProgramOutOfMemoryError``);
        its compilation record says how long it waited. The program is the one that call
        would have built: results are the same. False where that program exists already.
        """
        _, _, _, signature, build = self._prepared(batch)
        return self.cache.build_ahead(signature, functools.partial(build, compile=False),
                                      compile_program)

    def save_executable(self, path, batch, *, target=None) -> dict:
        """Compile the program a call with batches like ``batch`` would run and write it to
        ``path``, with its manifest beside it (``PATH.json``: the versions, platform, devices,
        inputs, settings and lowered module it was compiled for), for :meth:`load_executable`;
        nothing is run. ``target``: a TPU topology (``"v5e:1x1"``, ``"v5e:2x2"``) compiled
        for with XLA's TPU compiler, chips or not (:func:`tpu_train.compile.lower_step`).
        Returns the manifest (with ``seconds``: trace, lower, compile)."""
        from tpu_train.compile import saved_executable

        _, device, _, signature, build = self._prepared(batch)
        stages = cache_mod.TimedStages()
        if target is None:
            program = compile_program(build(stages, compile=False), stages)
            devices = self._program_devices(device)
            if stages.from_cache and device.platform == "cpu":
                # XLA:CPU serializes an executable it read back without its compiled code: the
                # file would load elsewhere and fail at its first call.
                raise saved_executable.CannotSaveError(
                    "the CPU client's program came from the persistent compilation cache, which "
                    "it cannot write out again; run this command with TPU_TRAIN_CACHE_DIR=off")
        else:
            from tpu_train.compile.lowering import lower_step
            from tpu_train.compile.targets import target_of

            target = target_of(target)
            program = lower_step(self, batch, target=target)
            stages.seconds.update(program.seconds)
            devices = (list(target.devices) if self.settings.mesh is not None
                       else [target.devices[0]])
        compiled = getattr(program.executable, "compiled", program.executable)
        manifest = saved_executable.save(
            compiled, program.lowered, path,
            environment_facts=saved_executable.environment(devices, self._mesh_shape()),
            signature=saved_executable.signature_facts(signature))
        return {**manifest, "seconds": dict(stages.seconds)}

    def load_executable(self, path, batch) -> None:
        """Use the executable :meth:`save_executable` wrote to ``path`` for batches like
        ``batch``: the program is traced and lowered now, as a call would, and the saved
        executable stands in for XLA's compile once its manifest matches this process (versions,
        platform, devices), this step (inputs, settings) and the lowered module; otherwise an
        :class:`~tpu_train.compile.saved_executable.ExecutableMismatchError` names what
        differs. Batches of other shapes compile as usual."""
        from tpu_train.compile import saved_executable
        from tpu_train.compile.program import load_program

        manifest = saved_executable.read_manifest(path)
        _, device, _, signature, build = self._prepared(batch)
        devices = self._program_devices(device)
        saved_executable.check_environment(
            path, manifest, saved_executable.environment(devices, self._mesh_shape()))
        saved_executable.check_signature(path, manifest,
                                         saved_executable.signature_facts(signature))

        def load(stages):
            return load_program(build(stages, compile=False), path, manifest,
                                None if self.settings.mesh is not None else devices, stages)

        self.cache.get_or_build(signature, load)

    def _program_devices(self, device) -> list:
        mesh = self.settings.mesh
        return [device] if mesh is None else list(mesh.devices.flat)

    def _mesh_shape(self) -> dict | None:
        mesh = self.settings.mesh
        if mesh is None:
            return None
        return dict(zip(mesh.axis_names, map(int, mesh.devices.shape)))

    def __call__(self, batch) -> dict[str, torch.Tensor]:
        plan, entry, steps, outputs = self._launch(batch)
        return self._finish(plan, entry, steps, outputs)

    def _launch(self, batch) -> tuple:
        """Prepare the call and dispatch the program: ``(plan, entry, step counts, outputs)``.

        The argument lists live in this frame only. Once it returns, the write-back in
        :meth:`_finish` drops the last references to the donated input arrays, so that
        releasing their hundreds of Python objects happens while the program runs: held
        until the call returned, it came after the call's wait for its flag, with the device
        idle (docs/benchmarks.md, W1 on the chip)."""
        plan, device, arguments, signature, build = self._prepared(batch)
        param_arrays, state_arrays, const_arrays, batch_arrays, scalars, steps, stacked = \
            arguments
        entry = self.cache.get_or_build(signature, build)
        if entry.stacking is not None or stacked is not None:
            param_arrays, state_arrays = self._stacked_arguments(
                plan, entry.stacking, device, (param_arrays, state_arrays), stacked)
        args = [param_arrays, state_arrays, const_arrays, batch_arrays, scalars,
                entry.layer_index_values(device)]
        if entry.random:
            args.append(rng.next_key(plan.device_index))
        return plan, entry, steps, entry.executable(*args)

    def _finish(self, plan: CallPlan, entry, steps: list, outputs) -> dict[str, torch.Tensor]:
        """Everything after the program is dispatched: the new values into the user's tensors,
        the scheduler's step, the result. Nothing here waits for the program."""
        new_params, new_states, new_consts, metrics, *own_norm = outputs
        st, index = plan.inputs, plan.device_index
        self._stacked = None
        if entry.stacking is not None:
            self._stacked = StackedCall.write(plan, entry.stacking, new_params, new_states)
        elif not plan.write_whole(new_params + new_states):
            n_params = len(st.params)
            self._write_back(st.params, plan.whole[:n_params], new_params)
            self._write_back(st.states, plan.whole[n_params:], new_states)
        for position, value in zip(entry.mutated_consts, new_consts):
            write_elements(st.consts[position], value)
        # Whoever reads one metric (the loop's loss, settle()'s flag) reads them all.
        metrics.copy_to_host_async()
        # What torch's own optimizer.step() wrapper records, so that lr schedulers see an
        # optimizer step before their own (and do not warn that the order is wrong).
        self.optimizer._opt_called = True
        if self.scheduler is not None:
            self.scheduler.step()
        # The gradient norm is always measured (it is almost free next to the update), also
        # without clipping, so the metrics have the same keys in every configuration.
        out = _metric_tensors(metrics, own_norm[0] if own_norm else None,
                              entry.grad_norm_dtype, index, self.settings.skip_non_finite)
        # The step counts advance now; where the update turns out skipped, settle() puts them
        # back (which leaves them, and so the bias corrections, as they were).
        groups = self.optimizer.param_groups
        for group, step in zip(groups, steps):
            self.adapter.set_step_count(group, step)
        if self.settings.skip_non_finite:
            self._unsettled = (metrics, list(zip(groups, steps)))
        self._scalars_ahead.put(host_scalars(self.optimizer, self.adapter)[0],
                                entry.scalars_placement(runtime.jax_device(index)))
        return out

    def settle(self) -> None:
        """Put the optimizer's step counts back where the last call's update was skipped
        (``skip_non_finite``), reading its flag: a wait for the device unless the step's
        metrics are on the host already. Runs by itself before the next call and before the
        optimizer's ``state_dict()``, ``load_state_dict()`` and ``step()``; call it before
        reading ``optimizer.state[p]["step"]`` directly."""
        unsettled, self._unsettled = self._unsettled, None
        if unsettled is None:
            return
        metrics, counts = unsettled
        if not read_finite(metrics):
            for group, step in counts:
                self.adapter.set_step_count(group, step - 1)

    @staticmethod
    def _write_back(tensors, whole_flags, new_values):
        for t, whole, value in zip(tensors, whole_flags, new_values):
            if whole:
                storage_of(t).buffer = value
            else:
                write_elements(t, value.reshape(tuple(t.shape)))

    # ------------------------------------------------------------------ introspection

    @property
    def compilations(self) -> list[cache_mod.CompileRecord]:
        """One record per compilation so far (cause, trace / lower / compile seconds)."""
        return list(self.cache.records)


def compile_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *,
                       scheduler=None, max_grad_norm: float | None = None,
                       grad_accum_steps: int = 1, donate: bool = True,
                       warn_after: int = cache_mod.DEFAULT_WARN_AFTER,
                       mesh=None, plan=None,
                       autocast_dtype: torch.dtype | None = None,
                       skip_non_finite: bool = False,
                       scan_layers: bool | None = None,
                       autodiff: str = "jax",
                       compute_dtype: torch.dtype | None = None) -> CompiledTrainStep:
    """Compile ``loss_fn`` + backward + clipping + ``optimizer.step()`` into one program.

    Args:
        model: an ``nn.Module`` on the ``tpu`` device.
        optimizer: any ``torch.optim.Optimizer`` over (some of) its parameters, including a
            user subclass: Adam/AdamW/SGD run hand-written updates, others their own
            ``step()`` traced into the program (not LBFGS, which needs a closure, or SparseAdam).
        loss_fn: ``loss_fn(model, batch)``, ordinary PyTorch code returning a 0-dim loss
            (averaged over micro-batches) or a tuple ``(loss_sum, count)`` (the step divides
            the sums over all micro-batches by the total count: token-weighted accumulation,
            like summing ``loss_sum / total_count`` backward passes in eager code).
        scheduler: an ``torch.optim.lr_scheduler`` on ``optimizer``; stepped after each call.
        max_grad_norm: clip gradients by global 2-norm like ``clip_grad_norm_``.
        grad_accum_steps: split each batch into this many consecutive micro-batches along
            dim 0 and average their gradients (and losses) inside the program.
        donate: let XLA reuse the old parameter and optimizer-state buffers for the new ones
            (halves their memory; the old arrays are invalid afterwards — tensors that share
            a storage with a parameter still see the new value).
        warn_after: log a warning when the step compiles more than this many times.
        mesh, plan: a ``tpu_train.parallel`` mesh and sharding plan (both or neither): one
            SPMD program over the mesh; parameters and optimizer state become global arrays
            split per the plan (``tpu_train.parallel.place_for_step`` places them up front).
            A mesh with a ``context`` axis splits every sequence over it
            (``tpu_train.compile.context_parallel``): ``loss_fn`` then gets the batch's
            ``[batch, seq]`` tensors permuted and ``position_ids`` added, which it must pass
            to the model.
        autocast_dtype: ``torch.bfloat16`` (or ``float16``) traces ``loss_fn`` under
            ``torch.autocast("tpu", dtype=autocast_dtype)``: matmuls and convolutions in that
            dtype, reductions, norms and losses in float32, parameters, gradients and the
            optimizer update stay float32. Without it, a ``torch.autocast("tpu", ...)`` region
            active around the step call is honoured the same way (its dtype is part of the
            compile signature).
        skip_non_finite: apply the update only when the loss and the gradient norm are both
            finite, decided inside the program (the old parameters, optimizer state and step
            counts are kept otherwise; the scheduler still steps). Adds ``finite`` to the
            result, 1.0 where the update was applied and 0.0 where not, read with the loss;
            the call still does not wait for the device (step counts: ``settle``).
        scan_layers: trace a stack of identical layers (an ``nn.ModuleList`` of one class
            with the same parameter shapes, called one after the other) once and run it as
            a ``lax.scan`` over their stacked parameters: trace and compile time grow far
            less with depth (``tpu_train.compile.layer_groups``). None (default): stacks of
            at least ``SCAN_MIN_LAYERS`` (20) layers; True: every stack; False: none. Where
            the model does not call its layers as such a stack, they are traced one by one.
        autodiff: ``"jax"`` (default): trace the forward only and let JAX differentiate it,
            where the forward graph carries all of autograd's behaviour (no ``detach`` /
            ``no_grad`` / hook / custom ``autograd.Function`` touching the gradient path, no
            buffer written by the forward, no scanned stack: ``tpu_train.compile.loss_graph``);
            otherwise, and with ``"torch"``, PyTorch's backward is traced.
        compute_dtype: ``torch.bfloat16`` runs the forward and backward with the floating
            parameters cast to bf16 (as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` and
            TPU training stacks do): activations, the residual stream and every dot stay in
            bf16 where the model does not upcast (statistics, softmax, the loss: a model's own
            ``.float()`` calls); the parameters, their gradients and the optimizer update
            keep the parameters' dtype (float32 master weights). Unlike ``autocast_dtype``,
            nothing is left in float32 because an operand was float32.

    Returns:
        ``step(batch) -> {"loss", "grad_norm", "lr"}`` (plus ``"finite"`` with
        ``skip_non_finite``), 0-dim device tensors: the call does not wait for the device.
        ``batch`` is any pytree (dict, tuple, list) of tensors.
    """
    settings = StepSettings(max_grad_norm=max_grad_norm, grad_accum_steps=grad_accum_steps,
                            donate=donate, warn_after=warn_after, mesh=mesh, plan=plan,
                            autocast_dtype=autocast_dtype, skip_non_finite=skip_non_finite,
                            scan_layers=scan_layers, autodiff=autodiff,
                            compute_dtype=compute_dtype)
    return CompiledTrainStep(model, optimizer, loss_fn, settings, scheduler=scheduler)
