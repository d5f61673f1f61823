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
  either changes), and no storage was resized since (:data:`tpu_train.device.storage`'s count).

Anything else (a new batch shape, a changed setting, autocast) is part of the signature and
is compared on every call as before. Where a check fails, the inputs are collected again.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from typing import Any

import torch

from tpu_train.compile import cache as cache_mod
from tpu_train.compile.lowering import StepInputs
from tpu_train.device import storage as storage_mod
from tpu_train.device.tensor import TpuTensor, owns_whole_storage, storage_of

__all__ = ["CallPlan", "structure_generation"]

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


_GEOMETRY = operator.attrgetter("_storage", "key_part")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


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


@dataclasses.dataclass
class CallPlan:
    """One collection of a step's inputs and what calls derive from it (module docstring)."""

    inputs: StepInputs  # batch fields are those of the collecting call
    device_index: int
    whole: tuple  # per param / state tensor: passed (and donated) as its storage's buffer
    tensor_specs: tuple  # InputSpec per param, state and constant (the signature's fixed part)
    generation: int
    resizes: int
    group_params: list  # per param group: its params list object and a copy of its items
    requires_grad: tuple
    state_refs: list  # (param, key, state tensor)
    const_refs: list  # (owner dict, name, tensor)
    tensors: list  # every param, state and constant tpu tensor
    geometry: list  # (storage, key_part) per tensor of ``tensors``
    storages: frozenset  # ids of the param and state storages
    last: Any = None  # (batch specs, settings, signature) of the latest call

    @classmethod
    def collect(cls, step, inputs: StepInputs, device_index: int, whole: tuple,
                tensor_specs: tuple, generation: int) -> "CallPlan":
        optimizer = step.optimizer
        group_params = [(g["params"], list(g["params"])) for g in optimizer.param_groups]
        requires_grad = tuple(p.requires_grad for _, ps in group_params for p in ps)
        state_refs = []  # in collect_step_inputs' order
        for group in optimizer.param_groups:
            keys = step.adapter.state_keys_for(group)
            state_refs.extend((p, key, optimizer.state[p][key])
                              for p in group["params"] if p.requires_grad for key in keys)
        owners = _owners(step.model)
        const_refs = [owners[id(t)] + (t,) for t in inputs.consts]
        tensors = [t for t in inputs.params + inputs.states + inputs.consts
                   if isinstance(t, TpuTensor)]
        storages = frozenset(id(t._storage) for t in inputs.params + inputs.states
                             if isinstance(t, TpuTensor))
        return cls(inputs, device_index, whole, tensor_specs, generation,
                   storage_mod.resize_count(), group_params, requires_grad, state_refs,
                   const_refs, tensors, list(map(_GEOMETRY, tensors)), storages)

    def holds(self, step, batch_leaves: list) -> bool:
        """Do the user's objects still hold exactly what this plan collected (and does the
        batch share no storage with a donated parameter or state)?"""
        if any(isinstance(b, TpuTensor) and id(b._storage) in self.storages
               for b in batch_leaves):
            return False
        if structure_generation() != self.generation \
                or storage_mod.resize_count() != self.resizes:
            return False
        groups = step.optimizer.param_groups
        if len(groups) != len(self.group_params):
            return False
        for group, (params_list, items) in zip(groups, self.group_params):
            params = group["params"]
            if params is not params_list or len(params) != len(items) \
                    or not all(a is b for a, b in zip(params, items)):
                return False
        if tuple(_REQUIRES_GRAD(p) for _, ps in self.group_params for p in ps) \
                != self.requires_grad:
            return False
        state = step.optimizer.state
        for p, key, tensor in self.state_refs:
            held = state.get(p)
            if held is None or held.get(key) is not tensor:
                return False
        if not all(table.get(name) is t for table, name, t in self.const_refs):
            return False
        # Tuples of the same objects compare equal without calling their __eq__.
        return list(map(_GEOMETRY, self.tensors)) == self.geometry

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
