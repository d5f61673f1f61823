"""What a compiled step's call reads from the user's objects, collected once and checked cheaply.

Every call of a :class:`~tpu_train.compile.train_step.CompiledTrainStep` must feed the program the
tensors the module and optimizer hold *now*. Collecting them from scratch (walking the module
tree for parameters and buffers, naming every tensor, deciding which storages may be donated,
describing every input for the compile signature) costs ~10 ms of host time per call for a
150-tensor model, more than a small model's whole step on a TPU. A :class:`CallPlan` keeps
what one collection found and, on the next call, only checks that it still holds:

* no module anywhere registered a parameter, buffer or submodule since (PyTorch's global
  registration hooks count them: :func:`structure_generation`);
* the optimizer has the same param groups holding the same parameter objects, with the same
  ``requires_grad``, and the same optimizer-state tensors;
* each constant (a parameter outside the optimizer, a buffer) is still what its module holds
  under its name (``Module.to()`` and ``_apply`` replace them without the hooks);
* each tensor still has the same storage and geometry (a ``key_part`` is renewed whenever
  either changes, and counted: while no tensor changed, none is compared), and no storage was
  resized since (:data:`tpu_train.device.storage`'s count).

Every check is an identity comparison run by a C loop (``map``), so the whole check costs
tens of microseconds, not the milliseconds a Python loop over ~450 tensors would. And when
the param and state storages still hold exactly what the previous call wrote, those arrays
are the next call's inputs as they are (:meth:`CallPlan.reused_arrays`).

Anything else (a new batch shape, a changed setting, autocast) is part of the signature and
is compared on every call as before. Where a check fails, the inputs are collected again.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import threading
from typing import Any

import torch

from tpu_train.compile import cache as cache_mod
from tpu_train.compile import stacked_layers
from tpu_train.compile.lowering import StepInputs
from tpu_train.device import storage as storage_mod
from tpu_train.device import tensor as tensor_mod
from tpu_train.device.tensor import TpuTensor, owns_whole_storage, storage_of

__all__ = ["CallPlan", "StackedCall", "structure_generation"]

_generation = 0
_hooks_lock = threading.Lock()
_hooks_installed = False


def _bump(*_args) -> None:
    global _generation
    _generation += 1


def structure_generation() -> int:
    """How many parameters, buffers and submodules any module registered since the hooks
    were installed (the first call installs them)."""
    global _hooks_installed
    if not _hooks_installed:
        with _hooks_lock:
            if not _hooks_installed:
                module = torch.nn.modules.module
                module.register_module_parameter_registration_hook(_bump)
                module.register_module_buffer_registration_hook(_bump)
                module.register_module_module_registration_hook(_bump)
                _hooks_installed = True
    return _generation


_STORAGE = operator.attrgetter("_storage")
_KEY_PART = operator.attrgetter("key_part")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_BUFFER = operator.attrgetter("_buffer")
_PENDING = operator.attrgetter("_pending")
_NO_STATE: dict = {}


def _owners(model: torch.nn.Module) -> dict[int, tuple[dict, str]]:
    """``id(tensor) -> (the dict its module holds it in, its local name)`` for every
    parameter and buffer of ``model``."""
    owners: dict[int, tuple[dict, str]] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    owners.setdefault(id(tensor), (table, name))
    return owners


def _all_same(values, expected) -> bool:
    """Is every item of ``values`` the very object at the same place of ``expected``? (Identity
    only: comparing tensors or arrays with ``==`` would compare their elements.) Runs in C."""
    return all(map(operator.is_, values, expected))


@dataclasses.dataclass
class CallPlan:
    """One collection of a step's inputs and what calls derive from it (module docstring).

    The checks of :meth:`holds` and the reuse of the previous call's outputs
    (:meth:`step_arrays`) are identity comparisons over lists, run by C loops (``map``): a
    Python loop over a 150-tensor model's ~450 tensors costs more host time than a small
    model's whole step on a TPU. Tensors are never dictionary keys here: a lookup by tensor
    calls ``Tensor.__hash__`` in Python.
    """

    inputs: StepInputs  # batch fields are those of the collecting call
    device_index: int
    whole: tuple  # per param / state tensor: passed (and donated) as its storage's buffer
    tensor_specs: tuple  # InputSpec per param, state and constant (the signature's fixed part)
    generation: int
    resizes: int
    group_params: list  # per param group: its params list object and a copy of its items
    all_params: list  # every group's params, in order
    requires_grad: tuple
    state: Any  # optimizer.state, its keys and its values (per-parameter dicts) when collected
    state_keys: list
    state_values: list
    state_holders: list  # per state tensor: the dict that holds it, and its key there
    state_names: list
    const_tables: list  # per constant: the dict its module holds it in, and its name there
    const_names: list
    tensors: list  # every param, state and constant tpu tensor
    storages: list  # their storages,
    key_parts: list  # and geometries
    storage_ids: frozenset  # ids of the param and state storages
    # The param and state storages when every one is passed whole, else None; and what the
    # latest call wrote into them (its outputs, reused as the next call's inputs).
    whole_storages: list | None
    geometry_changes: int  # tensor_mod.geometry_changes() when storages and geometries matched
    written: list | None = None
    last: Any = None  # (batch specs, settings, signature) of the latest call
    # The constants' storages, and (their buffers, the arrays made of them) of the latest call.
    const_storages: list = dataclasses.field(default_factory=list)
    const_cache: tuple | None = None

    @classmethod
    def collect(cls, step, inputs: StepInputs, device_index: int, whole: tuple,
                tensor_specs: tuple, generation: int) -> "CallPlan":
        optimizer = step.optimizer
        group_params = [(g["params"], list(g["params"])) for g in optimizer.param_groups]
        all_params = [p for _, ps in group_params for p in ps]
        holders, names = [], []  # in collect_step_inputs' order
        for group in optimizer.param_groups:
            keys = step.adapter.state_keys_for(group)
            for p in group["params"]:
                if p.requires_grad:
                    holders.extend([optimizer.state[p]] * len(keys))
                    names.extend(keys)
        owners = _owners(step.model)
        tables = [owners[id(t)] for t in inputs.consts]
        tensors = [t for t in inputs.params + inputs.states + inputs.consts
                   if isinstance(t, TpuTensor)]
        param_and_state = inputs.params + inputs.states
        storages = frozenset(id(t._storage) for t in param_and_state if isinstance(t, TpuTensor))
        state = optimizer.state
        plan = cls(inputs, device_index, whole, tensor_specs, generation,
                   storage_mod.resize_count(), group_params, all_params,
                   tuple(map(_REQUIRES_GRAD, all_params)), state, list(state.keys()),
                   list(state.values()), holders, names, [t for t, _ in tables],
                   [n for _, n in tables], tensors, list(map(_STORAGE, tensors)),
                   list(map(_KEY_PART, tensors)), storages,
                   list(map(_STORAGE, param_and_state)) if all(whole) else None,
                   tensor_mod.geometry_changes())
        plan.const_storages = list(map(_STORAGE, inputs.consts))
        return plan

    def holds(self, step, batch_leaves: list) -> bool:
        """Do the user's objects still hold exactly what this plan collected (and does the
        batch share no storage with a donated parameter or state)?"""
        if any(isinstance(b, TpuTensor) and id(b._storage) in self.storage_ids
               for b in batch_leaves):
            return False
        if structure_generation() != self.generation \
                or storage_mod.resize_count() != self.resizes:
            return False
        optimizer = step.optimizer
        groups = optimizer.param_groups
        if len(groups) != len(self.group_params):
            return False
        for group, (params_list, items) in zip(groups, self.group_params):
            params = group["params"]
            if params is not params_list or len(params) != len(items) \
                    or not _all_same(params, items):
                return False
        if tuple(map(_REQUIRES_GRAD, self.all_params)) != self.requires_grad:
            return False
        # The same per-parameter state dicts under the same parameters (by iteration, not by
        # lookups), each still holding the same state tensors.
        state = optimizer.state
        if state is not self.state or len(state) != len(self.state_keys) \
                or not _all_same(state.keys(), self.state_keys) \
                or not _all_same(state.values(), self.state_values):
            return False
        inputs = self.inputs
        if not _all_same(map(dict.get, self.state_holders, self.state_names), inputs.states):
            return False
        if not _all_same(map(dict.get, self.const_tables, self.const_names), inputs.consts):
            return False
        # A tensor's storage and geometry change in place only through refresh_key_part,
        # which counts the changes and renews key_part (a new tuple each time).
        changes = tensor_mod.geometry_changes()
        if changes == self.geometry_changes:
            return True
        tensors = self.tensors
        if not (_all_same(map(_STORAGE, tensors), self.storages)
                and _all_same(map(_KEY_PART, tensors), self.key_parts)):
            return False
        self.geometry_changes = changes
        return True

    def reused_arrays(self) -> list | None:
        """The param and state arrays of this call when they are exactly what the latest call
        wrote (nobody replaced a buffer since, no copy into one is in flight): the program's
        outputs become its next inputs without a look at each tensor. None otherwise."""
        written, storages = self.written, self.whole_storages
        if written is None or any(map(_PENDING, storages)) \
                or not _all_same(map(_BUFFER, storages), written):
            return None
        return written

    def const_arrays(self) -> list:
        """The constants' arrays: those of the latest call while every constant's storage
        still holds the very buffer they were made of (a constant's geometry is the plan's,
        :meth:`holds` checked it), else made again."""
        storages, cache = self.const_storages, self.const_cache
        if cache is not None and not any(map(_PENDING, storages)) \
                and _all_same(map(_BUFFER, storages), cache[0]):
            return cache[1]
        arrays = [t.jax_value() for t in self.inputs.consts]  # resolves copies in flight
        self.const_cache = (list(map(_BUFFER, storages)), arrays)
        return arrays

    def write_whole(self, outputs: list) -> bool:
        """Make ``outputs`` (new params then new states) the storages' buffers when every one
        is passed whole (False, nothing written, otherwise). The call read every buffer just
        before (resolving any copy in flight), so a plain assignment is the setter's work."""
        storages = self.whole_storages
        if storages is None:
            return False
        collections.deque(map(setattr, storages, itertools.repeat("_buffer"), outputs), maxlen=0)
        self.written = outputs
        return True

    def signature(self, batch_specs: tuple, settings: tuple) -> cache_mod.Signature:
        """The call's signature; the one of the latest call when nothing changed (no hashing
        of the hundreds of fixed input specs then)."""
        last = self.last
        if last is not None and last[0] == batch_specs and last[1] == settings:
            return last[2]
        signature = cache_mod.Signature(self.tensor_specs + batch_specs, settings)
        self.last = (batch_specs, settings, signature)
        return signature


def donatable(inputs: StepInputs) -> tuple:
    """Per param / state tensor: may its storage buffer be passed (and donated) as is?

    Only when the tensor is its whole storage and no other input reads that storage: a
    buffer given twice (tied tensors, a module buffer that views a parameter) must not be
    donated, so those tensors go in as copies and are written back through their geometry.
    """
    uses: dict[int, int] = {}
    for t in inputs.params + inputs.states + inputs.consts + inputs.batch_leaves:
        if isinstance(t, TpuTensor):
            storage = storage_of(t)
            uses[id(storage)] = uses.get(id(storage), 0) + 1
    return tuple(owns_whole_storage(t) and uses[id(storage_of(t))] == 1
                 for t in inputs.params + inputs.states)


def _holds_slice(storage, layer_slice) -> bool:
    pending = storage._pending
    return pending is layer_slice or (
        pending is None and layer_slice.produced is not None
        and storage._buffer is layer_slice.produced)


@dataclasses.dataclass
class StackedCall:
    """What a call of a program with stacked slots (:mod:`.stacked_layers`) left in the user's
    storages: each stacked layer's storage reads its element of the stacked output when first
    read (:class:`.stacked_layers.LayerSlice`), the other tensors' storages hold their outputs.
    While that still holds, the stacked outputs are the next call's arguments as they are."""

    plan: CallPlan
    stacking: Any  # the program's StackLayout
    arguments: tuple  # (param arrays, state arrays) as the program takes them
    storages: list  # each stacked layer's storage,
    slices: list  # and the LayerSlice it was left
    loose_storages: list
    loose_written: list

    @classmethod
    def write(cls, plan: CallPlan, stacking, new_params: list,
              new_states: list) -> "StackedCall | None":
        """Write a call's results (in the program's argument order) into the user's tensors;
        the record of it, or None where some tensor is not passed whole (no reuse then)."""
        st = plan.inputs
        n_params = len(st.params)
        loose = ([(st.params[i], plan.whole[i]) for i in stacking.loose_params]
                 + [(st.states[i], plan.whole[n_params + i]) for i in stacking.loose_states])
        loose_values = (new_params[:len(stacking.loose_params)]
                        + new_states[:len(stacking.loose_states)])
        for (tensor, whole), value in zip(loose, loose_values):
            if whole:
                storage_of(tensor).buffer = value
            else:
                tensor_mod.write_elements(tensor, value.reshape(tuple(tensor.shape)))
        storages, slices = [], []
        slots = ([(st.params, slot) for slot in stacking.param_slots]
                 + [(st.states, slot) for slot in stacking.state_slots])
        stacked = (new_params[len(stacking.loose_params):]
                   + new_states[len(stacking.loose_states):])
        for (tensors, slot), array in zip(slots, stacked):
            for layer, position in enumerate(slot):
                storage = storage_of(tensors[position])
                layer_slice = stacked_layers.LayerSlice(array, layer)
                storage.defer(layer_slice)
                storages.append(storage)
                slices.append(layer_slice)
        plan.written = None
        if not all(whole for _, whole in loose):
            return None
        return cls(plan, stacking, (new_params, new_states), storages, slices,
                   [storage_of(t) for t, _ in loose], loose_values)

    def reusable(self, plan: CallPlan) -> tuple | None:
        """``(param arrays, state arrays)`` of the latest call where ``plan`` is its plan and
        every storage still holds what it wrote (read, not replaced), else None."""
        if plan is not self.plan or any(map(_PENDING, self.loose_storages)) \
                or not _all_same(map(_BUFFER, self.loose_storages), self.loose_written) \
                or not all(map(_holds_slice, self.storages, self.slices)):
            return None
        return self.arguments
