"""In-place and ``out=`` ops as one executable: the functional lowering and the write.

``x.add_(y)`` is keyed like any op call (:func:`tpu_train.device.op_cache.call_key`). Its entry's
executable reads the arguments' views, runs the functional counterpart's lowering (``add.Tensor``),
casts to torch's dtypes and writes each result through its destination's geometry into that
storage's flat buffer, returning the new buffers; the host then swaps them into the storages, so
the base and every view see the write. Writes to one storage chain inside the executable (ops
with several destinations key which destinations share a storage). Anything the plan does not
map goes through the general path, :func:`tpu_train.device.mutation.run_mutating`, which
also raises the errors.
"""

from __future__ import annotations

import sys

import jax
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tpu_train.device import dispatch_thread, lazy, mutation, op_cache, runtime, scalars
from tpu_train.device import storage as storage_mod
from tpu_train.device.meta import device_index_of, meta_outputs
from tpu_train.device.op_cache import (NEEDS_VALUES, Decoder, OpInfo, Ref, call_key, cast_leaves,
                                       new_output, random_key, remember, wait)
from tpu_train.device.storage import contiguous_strides

_getrefcount = sys.getrefcount


class _Fresh:
    """Stands for the ``i``-th leaf of the functional op's result while planning."""

    __slots__ = ("leaf",)

    def __init__(self, leaf):
        self.leaf = leaf


class _Mutating:
    __slots__ = ("func", "run", "fn", "donating", "donate_slots", "index", "random", "written",
                 "fresh", "returns", "float_slots", "multi_tensor")

    def __init__(self, func, run, donate_slots, index, random, written, fresh, returns,
                 multi_tensor=False):
        self.func, self.run, self.index, self.random = func, run, index, random
        self.multi_tensor = multi_tensor
        self.fn = jax.jit(run, compiler_options=runtime.op_program_options())
        self.donating, self.donate_slots = None, donate_slots
        self.written, self.fresh, self.returns = written, fresh, returns
        self.float_slots = None  # found on the first call (the inputs)

    def __call__(self, args, kwargs, inputs, tensors, donate=True):
        if dispatch_thread.enabled:
            dispatch_thread.resolve(inputs)
        if self.random:
            inputs.append(random_key(args, kwargs, self.index))
        if lazy.active or (op_cache.batch and (self.multi_tensor or lazy.records_backward())):
            flat = self._record(inputs, first=not donate)
        else:
            if self.float_slots != ():
                scalars.place_floats(inputs, self)
            fn = self.fn
            if donate and _sole_owner(tensors, self.written):
                fn = self.donating or self._donating()
            flat = fn(*inputs)
            if op_cache._sync:
                wait(flat, self.func)
        for ordinal, buffer in zip(self.written, flat):
            tensors[ordinal]._storage.buffer = buffer
        index, n = self.index, len(self.written)
        fresh = [new_output(buffer, dtype, index, shape, strides)
                 for buffer, (dtype, shape, strides) in zip(flat[n:], self.fresh)]
        return self.returns(tensors, fresh)

    def _record(self, inputs, first):
        """Fused mode: the written buffers keep their storages' shapes and dtypes."""
        if first:  # a lowering that needs values fails here, not when the region runs
            jax.eval_shape(self.fn, *[lazy.aval_of(v) for v in inputs])
        avals = [(inputs[slot].shape, inputs[slot].dtype) for slot in self.donate_slots]
        avals += [op_cache.flat_aval(shape, dtype) for dtype, shape, _ in self.fresh]
        recorded = lazy.region(self.index).record(self.run, inputs, avals)
        return self.fn(*lazy.concrete(inputs)) if recorded is None else recorded

    def _donating(self):
        self.donating = jax.jit(self.run, donate_argnums=self.donate_slots,
                                compiler_options=runtime.op_program_options())
        return self.donating


def _sole_owner(tensors, ordinals) -> bool:
    """Is each written storage's buffer referenced only by its storage and the executable's
    input list? Then nothing can read the old value after the write, and the executable may
    update it in place (donation): a fresh output buffer costs page faults, several times
    the arithmetic of an optimizer update on the CPU client. Another reference (a second
    storage or a caller holding the array, the same buffer passed twice) keeps the copy."""
    for ordinal in ordinals:
        # References: the storage, the input list, getrefcount's own argument.
        if _getrefcount(tensors[ordinal]._storage._buffer) != 3:
            return False
    return True


def _sharing(tensors) -> tuple:
    """Per tensor argument, the first argument with the same storage: writes to one storage
    must chain inside the executable."""
    first: dict = {}
    return tuple(first.setdefault(id(t._storage), i) for i, t in enumerate(tensors))


def run_mutating(info: OpInfo, func, args, kwargs):
    if info.lowering is None:
        return mutation.run_mutating(func, args, kwargs)
    inputs, tensors = [], []
    try:
        key = call_key(info, args, kwargs, info.static_floats, inputs, tensors)
        cache_key = (key, _sharing(tensors)) if info.multi_dest else key
        entry = op_cache._ENTRIES.get(cache_key)
    except (op_cache.Unkeyable, TypeError):
        return mutation.run_mutating(func, args, kwargs)
    if entry is not None:
        return entry(args, kwargs, inputs, tensors)
    entry = _mutating_entry(info, func, args, kwargs, key, cache_key)
    if entry is None:
        return mutation.run_mutating(func, args, kwargs)
    try:
        result = entry(args, kwargs, inputs, tensors, donate=False)  # a first run may fail
    except NEEDS_VALUES as error:
        if isinstance(error, NotImplementedError) and "compiled" not in str(error):
            raise
        info.lowering = None  # the functional op needs values: the general path from now on
        return mutation.run_mutating(func, args, kwargs)
    remember(cache_key, entry)
    return result


def _mutating_entry(info: OpInfo, func, args, kwargs, key, cache_key):
    """Plan ``func`` as one executable, or None where the general path must run (it raises
    the errors, or handles results the plan does not map)."""
    functional = info.functional
    index = device_index_of(func, args, kwargs)
    # torch's meta kernel of the mutating op itself checks what the functional one cannot:
    # e.g. that an in-place result can be cast back to the destination's dtype.
    meta_outputs(func, args, kwargs)
    bound = mutation.bind_arguments(func, args, kwargs)
    functional_meta = meta_outputs(functional, *mutation.functional_arguments(func, functional,
                                                                              bound))
    leaves, tree = tree_flatten(functional_meta)
    if functional_meta is None or not all(isinstance(m, torch.Tensor) for m in leaves):
        return None
    specs = tuple((tuple(m.shape), m.dtype) for m in leaves)
    refs = mutation.bind_arguments(func, *Decoder(info, None).call(key))
    try:
        fresh, updates = mutation.split_results(
            func, functional, tree_unflatten([_Fresh(i) for i in range(len(leaves))], tree))
        pairs = mutation.written_pairs(func, functional, refs, updates)
    except (NotImplementedError, TypeError):
        return None
    sharing = cache_key[1] if cache_key is not key else None
    writes, written = [], []
    for destination, value in pairs:
        if not (isinstance(destination, Ref) and isinstance(value, _Fresh)
                and mutation._broadcastable(specs[value.leaf][0], destination.geometry[0])):
            return None
        first = sharing[destination.ordinal] if sharing else destination.ordinal
        writes.append((destination.slot, first, destination.geometry, value.leaf))
        if first not in written:
            written.append(first)
    if not all(isinstance(f, _Fresh) for f in fresh):
        return None
    fresh_leaves = [f.leaf for f in fresh]
    run = _mutating_program(info, func, key, specs, writes, written, fresh_leaves)
    layouts = [(specs[i][1], specs[i][0], contiguous_strides(specs[i][0])) for i in fresh_leaves]
    returns = _returns_builder(mutation.mutating_returns(func, refs, fresh), fresh_leaves)
    # The input each written storage's buffer arrives in (what may be donated).
    donate_slots = tuple(next(w[0] for w in writes if w[1] == first) for first in written)
    return _Mutating(func, run, donate_slots, index, info.lowering.random, written, layouts,
                     returns, info.multi_tensor)


def _mutating_program(info: OpInfo, func, key, specs, writes, written, fresh_leaves):
    lowering, functional = info.lowering, info.functional

    def run(*inputs):
        args, kwargs = Decoder(info, inputs).call(key)
        positional, functional_kwargs = mutation.functional_arguments(
            func, functional, mutation.bind_arguments(func, args, kwargs))
        if lowering.random:
            functional_kwargs["rng_key"] = inputs[-1]
        leaves = cast_leaves(functional, lowering.fn(*positional, **functional_kwargs), specs)
        buffers = {}
        for slot, first, geometry, leaf in writes:
            buffers[first] = storage_mod.write_in_trace(buffers.get(first, inputs[slot]),
                                                        leaves[leaf], *geometry)
        return [buffers[first] for first in written] + [leaves[i].reshape(-1)
                                                         for i in fresh_leaves]

    return run


def _returns_builder(plan, fresh_leaves):
    """(tensor arguments, fresh tensors) → what the op returns, from the planned returns."""
    if isinstance(plan, Ref):  # in-place ops: the destination itself
        ordinal = plan.ordinal
        return lambda tensors, fresh: tensors[ordinal]
    position = {leaf: i for i, leaf in enumerate(fresh_leaves)}

    def build(item, tensors, fresh):
        if isinstance(item, Ref):
            return tensors[item.ordinal]
        if isinstance(item, _Fresh):
            return fresh[position[item.leaf]]
        if isinstance(item, (list, tuple)):
            return type(item)(build(i, tensors, fresh) for i in item)
        return item

    return lambda tensors, fresh: build(plan, tensors, fresh)
