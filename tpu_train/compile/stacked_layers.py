"""A scanned stack's parameters and optimizer state held stacked, ``[L, ...]``, by the step.

A stack of ``L`` scanned layers (:mod:`.layer_scan`) has, per parameter *slot* (``wq``,
``w1``, a norm weight, ...), ``L`` parameters of one shape and dtype, each with its own
optimizer state. Passed to the program one tensor each, the program stacked every slot's
layers for the scan each step and sliced the gradients back out, and updated and took the norm
of every layer's tensors in per-layer kernels: for a 16-layer 350M Llama a third of XLA's
instructions for the whole step, outside the loops (docs/compile.md, "The scanned 350M step
against JAX's").

Here the program takes and returns one ``[L, ...]`` array per slot, for parameters and for each
optimizer state (:class:`StackLayout`); the scan consumes it as it is, the backward scan's
stacked gradient goes to the update as it is, and the update and gradient-norm templates run
once per slot under ``jax.vmap`` (:mod:`.update_templates`): the same elementwise ops on the
same values, a layer's norm the same reduction of the same elements.

While a program is traced, each layer's tensor is a *view*: ``stacked[j]``, registered here
(:func:`views`) with where it comes from. An op that knows stacks (the scan, a template map,
:func:`lift`) takes a complete set of views of one stack as the stack itself; anything else
reads the views as ordinary per-layer values (XLA drops the ones nobody reads), and
:func:`restack` stacks what it must: a program is always correct, and small where the values
stay views.

Between calls the layers' ``tpu`` storages read their element of the latest stacked output
when first read (:class:`LayerSlice`); a call whose storages still hold exactly that passes
the stacked outputs back in (:mod:`.train_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import torch

__all__ = ["StackLayout", "LayerSlice", "plan_stacks", "views", "view", "restack", "lift",
           "stack_slots", "whole_flags"]

# id(value) -> (value, stacked, layer) while a program is traced (None otherwise).
_views: dict | None = None


@contextlib.contextmanager
def views():
    """Register and recognise layer views while a step program is traced."""
    global _views
    previous, _views = _views, {}
    try:
        yield
    finally:
        _views = previous


def register(value, stacked, layer: int):
    """Record that ``value`` is ``stacked[layer]``; returns ``value``."""
    if _views is not None:
        _views[id(value)] = (value, stacked, layer)
    return value


def view(stacked, layer: int):
    """``stacked[layer]``, registered as a view."""
    return register(stacked[layer], stacked, layer)


def source(value):
    """``(stacked, layer)`` where ``value`` is a registered view, else None."""
    if _views is None:
        return None
    found = _views.get(id(value))
    if found is None or found[0] is not value:
        return None
    return found[1], found[2]


def whole_stack(values: Sequence):
    """The array ``values`` are the layers of, in order and every one, else None."""
    if not values:
        return None
    first = source(values[0])
    if first is None:
        return None
    stacked = first[0]
    if stacked.shape[0] != len(values):
        return None
    for layer, value in enumerate(values):
        found = source(value)
        if found is None or found[0] is not stacked or found[1] != layer:
            return None
    return stacked


def restack(values: Sequence):
    """``values`` stacked ``[L, ...]``: the array they are views of where they are its layers
    in order, else ``jnp.stack``."""
    stacked = whole_stack(values)
    return jnp.stack(list(values)) if stacked is None else stacked


def lift(values: Sequence, fn: Callable) -> list:
    """``[fn(i, v) for i, v in enumerate(values)]``, where the complete layer sets of one stack
    among ``values`` are computed once as ``vmap(fn)`` of the stack with its first member's
    ``i`` (``fn`` maps one layer's value alone, as a reshape, a cast or a scaling does, and
    does the same for every layer of a slot) and returned as views of the result."""
    values = list(values)
    out: list = [None] * len(values)
    members: dict[int, list] = {}
    for position, value in enumerate(values):
        found = source(value)
        if found is not None:
            members.setdefault(id(found[0]), []).append(position)
    for positions in members.values():
        group = [values[p] for p in positions]
        stacked = whole_stack(group)
        if stacked is None:
            continue
        result = jax.vmap(functools.partial(fn, positions[0]))(stacked)
        for layer, p in enumerate(positions):
            out[p] = view(result, layer)
    return [fn(i, v) if o is None else o for i, (v, o) in enumerate(zip(values, out))]


@dataclasses.dataclass(frozen=True)
class StackLayout:
    """Which parameters and optimizer states the program takes stacked, one ``[L, ...]``
    argument per slot (layer order), after the others (``loose_*``, in their own order)."""

    param_slots: tuple  # per slot: the parameter indices of its layers
    state_slots: tuple  # per slot: the state indices of its layers
    loose_params: tuple
    loose_states: tuple

    def expand(self, program_values: Sequence, states: bool = False) -> list:
        """Per-tensor values (views for the stacked ones) from the program's parameter (or
        with ``states`` state) arguments."""
        slots, loose = self._of(states)
        out: list = [None] * (len(loose) + sum(map(len, slots)))
        for position, value in zip(loose, program_values):
            out[position] = value
        for slot, stacked in zip(slots, program_values[len(loose):]):
            for layer, position in enumerate(slot):
                out[position] = view(stacked, layer)
        return out

    def pack(self, values: Sequence, states: bool = False) -> list:
        """The program's parameter (or state) arguments, or results, from per-tensor values."""
        slots, loose = self._of(states)
        return [values[i] for i in loose] + [restack([values[i] for i in slot])
                                             for slot in slots]

    def structs(self, structs: Sequence, states: bool = False) -> list:
        """The arguments' ``jax.ShapeDtypeStruct`` from the per-tensor ones."""
        slots, loose = self._of(states)

        def stacked(slot):
            first = structs[slot[0]]
            return jax.ShapeDtypeStruct((len(slot),) + tuple(first.shape), first.dtype,
                                        sharding=first.sharding)

        return [structs[i] for i in loose] + [stacked(slot) for slot in slots]

    def _of(self, states: bool) -> tuple:
        return (self.state_slots, self.loose_states) if states \
            else (self.param_slots, self.loose_params)


def stack_slots(arrays: Sequence, slots: tuple, loose: tuple) -> list:
    """Per-tensor arrays (outside a trace) in a :class:`StackLayout`'s argument order."""
    return [arrays[i] for i in loose] + [_stack(*[arrays[i] for i in slot]) for slot in slots]


@jax.jit
def _stack(*arrays):
    return jnp.stack(arrays)


@jax.jit
def _take(stacked, layer):
    return jax.lax.dynamic_index_in_dim(stacked, layer, keepdims=False)


class LayerSlice:
    """Layer ``layer`` of ``stacked``, made when first asked for: what a layer's storage
    reads between calls (the interface of :meth:`tpu_train.device.storage.Storage.fill_later`'s
    futures). ``produced`` is the array once made."""

    __slots__ = ("stacked", "layer", "produced")

    def __init__(self, stacked, layer: int):
        self.stacked, self.layer, self.produced = stacked, layer, None

    def result(self):
        if self.produced is None:
            self.produced = _take(self.stacked, jnp.int32(self.layer))
            self.stacked = None
        return self.produced

    @staticmethod
    def done() -> bool:
        return True


def whole_flags(st, values: dict | None) -> tuple:
    """Per parameter and state of the step inputs ``st``: passed whole, as the train step's
    call plan decided (``values["whole"]``), else as the tensor is stored (a tensor not on
    the ``tpu`` device, as a step lowered from ``meta`` tensors has, counts as whole)."""
    from tpu_train.device.tensor import TpuTensor, owns_whole_storage

    if values is not None and values.get("whole") is not None:
        return tuple(values["whole"])
    return tuple(owns_whole_storage(t) if isinstance(t, TpuTensor) else True
                 for t in st.params + st.states)


def plan_stacks(grad_gm: torch.fx.GraphModule, n_params: int, state_counts: Sequence[int],
                state_metas: Sequence[tuple], whole: Sequence[bool]) -> StackLayout | None:
    """The :class:`StackLayout` of the scanned stacks in ``grad_gm`` (None: no slot).

    A slot is stacked where every layer's tensor is a parameter the program passes whole
    (``whole``: per parameter then per state) read straight from its input, and every layer's
    optimizer states have the same shapes and dtypes (``state_metas``: per state)."""
    from tpu_train.compile import layer_scan

    placeholders = [n for n in grad_gm.graph.nodes if n.op == "placeholder"]
    index = {node: i for i, node in enumerate(placeholders[:n_params])}
    starts, cursor = [], 0
    for count in state_counts:
        starts.append(cursor)
        cursor += count
    taken: set = set()
    param_slots, state_slots = [], []
    for node in grad_gm.graph.nodes:
        if node.target is not layer_scan.LAYER_SCAN:
            continue
        b = layer_scan.body(node.args[0])
        tensors = node.args[1]
        n = (len(tensors) - b.n_inputs) // b.n_states if b.n_states else 0
        for s in range(b.n_states):
            members = [index.get(tensors[layer * b.n_states + s]) for layer in range(n)]
            if n < 2 or None in members or taken.intersection(members) \
                    or len(set(members)) != n or not all(whole[i] for i in members):
                continue
            count = state_counts[members[0]]
            states = [[starts[i] + k for i in members] for k in range(count)]
            if any(state_counts[i] != count for i in members) or any(
                    len({state_metas[i] for i in slot}) != 1 or not all(
                        whole[n_params + i] for i in slot) for slot in states):
                continue
            taken.update(members)
            param_slots.append(tuple(members))
            state_slots.extend(tuple(slot) for slot in states)
    if not param_slots:
        return None
    in_params = {i for slot in param_slots for i in slot}
    in_states = {i for slot in state_slots for i in slot}
    return StackLayout(tuple(param_slots), tuple(state_slots),
                       tuple(i for i in range(n_params) if i not in in_params),
                       tuple(i for i in range(len(state_metas)) if i not in in_states))
