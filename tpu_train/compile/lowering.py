"""Lowering a PyTorch training step to one XLA program, without running it.

:func:`lower_train_step` is the public entry: from a model, an optimizer, a loss function and
a batch it traces forward, backward, clipping and the optimizer update and returns the lowered
(and, by default, compiled) :class:`~tpu_train.compile.program.Program`, whose
:meth:`~tpu_train.compile.program.Program.analysis` gives XLA's per-device memory and FLOPs.
``compile_train_step`` goes through the same :func:`collect_step_inputs` and
:func:`lower_collected`, adding a compile cache and the write-back of the results.

Only shapes and dtypes are read where no values are needed: a model built on the ``meta``
device, a batch of ``meta`` tensors and a mesh of virtual devices lower a pod-sized step on a
laptop (what ``tpu-train plan`` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_flatten_with_path

from tpu_train.compile import cache as cache_mod
from tpu_train.compile import program as program_mod
from tpu_train.compile.functional_optim import OptimizerAdapter, adapter_for
from tpu_train.compile.spmd import place_global
from tpu_train.compile.step_settings import StepSettings, check_autocast_dtype
from tpu_train.device import autocast, lazy, runtime

__all__ = ["StepDefinition", "StepInputs", "autocast_region", "batch_structure",
           "collect_step_inputs", "flatten_batch", "ScalarsAhead", "host_scalars",
           "lower_collected", "lower_step", "lower_train_step", "step_autocast_dtype"]


@dataclasses.dataclass(frozen=True)
class StepDefinition:
    """What one training step computes (``CompiledTrainStep`` carries the same fields)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.nn.Module, Any], Any]
    adapter: OptimizerAdapter
    settings: StepSettings = StepSettings()


@dataclasses.dataclass
class StepInputs:
    """The tensors one step reads, in program order, with their names."""

    params: list  # optimizer params that receive gradients, group by group
    param_names: list
    group_sizes: list
    states: list  # flat optimizer state tensors
    state_names: list
    state_counts: list  # per param
    consts: list  # other module params, buffers and frozen optimizer params
    const_names: list
    batch_leaves: list
    batch_names: list
    batch_spec: Any


def batch_key_name(path) -> str:
    """``batch['tokens']``-style name of a batch leaf from its pytree path."""
    parts = []
    for entry in path:
        if hasattr(entry, "key"):
            parts.append(f"[{entry.key!r}]")
        elif hasattr(entry, "idx"):
            parts.append(f"[{entry.idx}]")
        else:
            parts.append(f"[{entry}]")
    return "batch" + "".join(parts)


def _batch_leaves(batch) -> tuple[list, list, Any]:
    # torch's pytree (not JAX's, which sorts dict keys) so that leaf order matches the spec
    # the traced function unflattens with.
    leaves_with_paths, torch_spec = tree_flatten_with_path(batch)
    if not leaves_with_paths:
        raise ValueError("the batch holds no tensors")
    leaves, names = [], []
    for path, leaf in leaves_with_paths:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{batch_key_name(path)} is a {type(leaf).__name__}; the batch may "
                            "only hold tensors (pass constants through loss_fn instead)")
        leaves.append(leaf)
        names.append(batch_key_name(path))
    return leaves, names, torch_spec


def flatten_batch(batch, known=None) -> tuple[list, list, Any]:
    """``(leaves, names, spec)`` of a batch pytree. ``known``: :func:`batch_structure` of an
    earlier batch, whose names and spec are reused when the structure is the same (naming
    leaves from their paths costs more than the rest of a compiled step's host work)."""
    if known is not None:
        if type(batch) is dict:  # the common case, without building a tree spec
            structure = ("dict", tuple(batch))
            leaves = list(batch.values())
        else:
            leaves, structure = tree_flatten(batch)
        if structure == known[0] and all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            return leaves, known[1], known[2]
    leaves, names, spec = _batch_leaves(batch)
    return leaves, names, spec


def batch_structure(batch, names, spec) -> tuple:
    """What :func:`flatten_batch` compares a later batch with: ``(structure, names, spec)``."""
    structure = ("dict", tuple(batch)) if type(batch) is dict else spec
    return structure, names, spec


def create_missing_state(optimizer, adapter: OptimizerAdapter) -> None:
    """Create the optimizer state the first step needs (``adapter.ensure_state``), recorded in
    fused mode and run as one program: strict mode would compile a program per parameter
    shape for its zeros (~0.1 s each on a TPU, all before the first step can start)."""
    missing = any(p.requires_grad and not optimizer.state.get(p)
                  for group in optimizer.param_groups for p in group["params"])
    if not missing:
        return
    recording = lazy.mode() == lazy.STRICT
    with lazy.eager_mode(lazy.FUSED) if recording else contextlib.nullcontext():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    adapter.ensure_state(p, group)


def collect_step_inputs(model, optimizer, adapter: OptimizerAdapter, batch,
                        name_of: Callable[[torch.Tensor], str]) -> StepInputs:
    """Read the step's tensors from the user's objects (creating missing optimizer state, as
    the optimizer's first step would)."""
    create_missing_state(optimizer, adapter)
    params, names, sizes, states, state_names, counts = [], [], [], [], [], []
    in_optimizer = set()
    for group in optimizer.param_groups:
        keys = adapter.state_keys_for(group)
        size = 0
        for p in group["params"]:
            in_optimizer.add(id(p))
            if not p.requires_grad:
                continue
            adapter.ensure_state(p, group)
            params.append(p)
            names.append(name_of(p))
            state = optimizer.state[p]
            for key in keys:
                states.append(state[key])
                state_names.append(f'optimizer state "{key}" of "{names[-1]}"')
            counts.append(len(keys))
            size += 1
        sizes.append(size)
    consts, const_names = [], []
    for name, t in model.named_parameters():
        if id(t) not in in_optimizer or not t.requires_grad:
            consts.append(t)
            const_names.append(name)
    for name, t in model.named_buffers():
        consts.append(t)
        const_names.append(name)
    leaves, leaf_names, spec = _batch_leaves(batch)
    return StepInputs(params, names, sizes, states, state_names, counts, consts, const_names,
                      leaves, leaf_names, spec)


def host_scalars(optimizer, adapter: OptimizerAdapter) -> tuple[np.ndarray, list[int]]:
    """The next step's per-group host scalars (lr, bias corrections...) and step counts."""
    groups = optimizer.param_groups
    steps = [adapter.step_count(g) + 1 for g in groups]
    scalars = np.array([adapter.host_scalars(g, s) for g, s in zip(groups, steps)],
                       dtype=np.float32).reshape(len(groups), adapter.num_scalars)
    return scalars, steps


class ScalarsAhead:
    """The next call's host scalars, put on the device while this call's program runs.

    A program waits for every host argument's transfer before it starts (~0.3 ms on a v5e,
    whatever the size: docs/benchmarks.md). The next step's lr and bias corrections are known
    once a call has advanced the step counts and the scheduler, so they can travel during
    the step; the next call takes them only where they equal what it computes itself (a
    changed lr, or step counts a skipped update put back, get the host array as before)."""

    def __init__(self) -> None:
        self._values: np.ndarray | None = None
        self._array = None

    def put(self, values: np.ndarray, sharding) -> None:
        self._values, self._array = values, place_global(values, sharding)

    def take(self, values: np.ndarray):
        """The array put ahead where it holds ``values``, else ``values`` (once each)."""
        ahead, array = self._values, self._array
        self._values = self._array = None
        if ahead is not None and np.array_equal(ahead, values):
            return array
        return values


def step_autocast_dtype(explicit: torch.dtype | None) -> torch.dtype | None:
    """The autocast dtype a compiled step traces its loss with.

    ``explicit`` (``compile_train_step(autocast_dtype=...)``) wins; without it, an
    ``torch.autocast("tpu", ...)`` region active around the step call is honoured, as eager
    code under the same ``with`` block would be. ``None``: no autocast.
    """
    if explicit is not None:
        check_autocast_dtype(explicit)
        return explicit
    if torch.is_autocast_enabled(autocast.DEVICE_TYPE):
        return torch.get_autocast_dtype(autocast.DEVICE_TYPE)
    return None


def autocast_region(dtype: torch.dtype | None):
    """A context that enables autocast on the tpu device with ``dtype``, or disables it."""
    autocast.register()
    if dtype is None:
        return torch.autocast(autocast.DEVICE_TYPE, enabled=False)
    return torch.autocast(autocast.DEVICE_TYPE, dtype=dtype)


def lower_collected(step, inputs: StepInputs, scalars: np.ndarray,
                    stages: cache_mod.TimedStages, *, values: dict | None = None, device=None,
                    mesh=None, plan=None, autocast_dtype: torch.dtype | None = None,
                    compile: bool = True, runtime_options: bool = False) -> program_mod.Program:
    """Trace and lower (and compile) ``step`` for already collected ``inputs``.

    ``step``: a :class:`StepDefinition` or a ``CompiledTrainStep``. The loss is traced under
    ``autocast_dtype`` (the update graph disables autocast itself), whatever autocast region
    surrounds the call. ``values`` (the arrays the step will be called with) may be None:
    inputs are then described from their shapes and dtypes alone. ``runtime_options``: compile
    with the runtime's XLA options for the program's platform, as a step that runs here does
    (False: XLA's defaults, what the planner reports for another chip).
    """
    options = None
    if runtime_options:
        options = runtime.compiler_options(
            (mesh.devices.flat[0] if mesh is not None else device).platform)
    with autocast_region(autocast_dtype):
        return program_mod.build_program(step, inputs, values, scalars, device, stages,
                                         mesh=mesh, plan=plan, compile=compile,
                                         compiler_options=options)


def _tensor_names(model) -> Callable[[torch.Tensor], str]:
    names = {id(t): n for n, t in model.named_parameters(remove_duplicate=False)}
    names.update({id(t): n for n, t in model.named_buffers(remove_duplicate=False)})
    return lambda t: names.get(id(t), f"<unnamed tensor {id(t):x}>")


def lower_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     loss_fn: Callable[[torch.nn.Module, Any], Any], batch, *,
                     compile: bool = True, runtime_options: bool = True, target=None,
                     **settings: Any) -> program_mod.Program:
    """The program ``compile_train_step`` would run for ``batch``, lowered but never executed.

    ``settings`` are ``compile_train_step``'s keywords (:class:`StepSettings`); ``batch`` is a
    pytree of tensors whose shapes and dtypes are read (``meta`` tensors will do). The model may
    live on the ``tpu`` device or on ``meta``: nothing is read from its values, and missing
    optimizer state is created like the parameters (``meta`` for a ``meta`` model). ``mesh``
    and ``plan`` (both or neither) lower the SPMD program over the mesh; without them the
    program is for the model's ``tpu`` device (``tpu:0`` for a ``meta`` model).
    ``compile=False`` stops after lowering.
    ``runtime_options=False`` compiles with XLA's defaults instead of the runtime's options for
    this process's platform (the planner: it reports XLA's buffers for another chip).
    ``target``: compile for a TPU that need not be here (:func:`lower_step`).

    Returns the :class:`~tpu_train.compile.program.Program`: ``lowered`` (``jax.stages.Lowered``),
    ``executable`` (None without compile), ``analysis()`` (XLA's memory and FLOPs per device)
    and ``seconds`` (trace / lower / compile).
    """
    step = StepDefinition(model, optimizer, loss_fn, adapter_for(optimizer),
                          StepSettings(**settings))
    return lower_step(step, batch, target=target, compile=compile,
                      runtime_options=runtime_options)


def _placement_for(step, target) -> tuple[Any, Any, Any]:
    """``(device, mesh, plan)`` to lower ``step`` for: its own, or the ``target``'s chips
    (a step with a mesh keeps its axes, laid over the target's devices)."""
    mesh, plan = step.settings.mesh, step.settings.plan
    if target is None:
        return None, mesh, plan
    from tpu_train.compile.targets import TargetError, target_of

    target = target_of(target)
    if mesh is None:
        if target.num_chips != 1:
            raise TargetError(f"target {target.name} has {target.num_chips} chips but the step "
                              "has no mesh and plan: pass mesh= and plan= (any devices; the "
                              "mesh's axes are laid over the target's chips) or a 1-chip target")
        return target.devices[0], None, None
    return None, target.mesh(mesh.devices.shape, mesh.axis_names), plan


def lower_step(step, batch, *, target=None, compile: bool = True,
               runtime_options: bool = True) -> program_mod.Program:
    """The program ``step`` would run for ``batch``, lowered (and compiled) but never run.

    ``step``: a ``CompiledTrainStep`` (the one a trainer built: its optimizer, clipping,
    autocast, skipping and mesh) or a :class:`StepDefinition`. ``target``: a TPU topology name
    or :class:`~tpu_train.compile.targets.Target` (``"v5e"``, ``"v5e:2x2"``, ...): the program
    is lowered and compiled with XLA's TPU compiler for those chips, which need not be
    attached (libtpu must be installed); a 1-chip target takes a step without a mesh, a larger
    one a step with a mesh whose axes hold as many devices as the target has chips.
    """
    inputs = collect_step_inputs(step.model, step.optimizer, step.adapter, batch,
                                 _tensor_names(step.model))
    if not inputs.params:
        raise ValueError("the optimizer holds no parameter that requires grad")
    scalars, _ = host_scalars(step.optimizer, step.adapter)
    device, mesh, plan = _placement_for(step, target)
    if device is None and mesh is None:
        first = inputs.params[0].device
        device = runtime.jax_device((first.index or 0) if first.type == "tpu" else 0)
    stages = cache_mod.TimedStages()
    program = lower_collected(step, inputs, scalars, stages, device=device, mesh=mesh, plan=plan,
                              autocast_dtype=step_autocast_dtype(step.settings.autocast_dtype),
                              compile=compile, runtime_options=runtime_options)
    program.seconds = dict(stages.seconds)
    return program
