"""Eager execution of ATen ops on tpu tensors.

Every op reaching :meth:`TpuTensor.__torch_dispatch__` is routed here:

1. a few ops with device semantics of their own (``copy_``, ``_to_copy``, ``.item()``, ...)
   are handled in :mod:`tpu_train.device.special_ops`;
2. *view* ops only compute geometry (torch's meta kernels do it) and return a tensor sharing
   the base's storage — so writes through views are seen everywhere, as on a real device;
3. *mutating* ops (in-place, ``out=``) run their functional counterpart and write the result
   through the mutated tensors' geometry (:mod:`tpu_train.device.mutation`);
4. functional ops run their lowering from :mod:`tpu_train.ops`, each wrapped in a cached
   ``jax.jit``; output shapes and dtypes come from torch's meta kernels, so torch's type
   promotion and shape errors hold exactly;
5. ops without a lowering use torch's decompositions, then the CPU fallback when
   ``TPU_TRAIN_CPU_FALLBACK=1``, else raise ``NotImplementedError`` naming the op.

Dispatch is asynchronous (JAX's own): nothing waits for the device unless a value is read.
``TPU_TRAIN_SYNC=1`` waits after every op so that an error points at the op that caused it.
"""

from __future__ import annotations

import os

import jax
import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from tpu_train.device import generator, rng, runtime
from tpu_train.device import storage as storage_mod
from tpu_train.device.storage import Storage, contiguous_strides
from tpu_train.device.tensor import TpuTensor, host_array
from tpu_train.ops import registry
from tpu_train.ops.dtypes import storage_dtype

aten = torch.ops.aten

SYNC_ENV = "TPU_TRAIN_SYNC"
_sync = os.environ.get(SYNC_ENV, "") not in ("", "0")


def dispatch(func, args, kwargs):
    from tpu_train.device import fallback, mutation, special_ops

    handler = special_ops.HANDLERS.get(func)
    if handler is not None:
        return handler(func, args, kwargs)
    if torch.Tag.inplace_view in func.tags:
        return special_ops.inplace_view(func, args, kwargs)
    if func.is_view:
        if _has_composite_implicit(func):
            # "May alias" ops such as to.dtype or reshape: their composite kernel decides
            # whether the result is a view or a copy.
            result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return run_view(func, args, kwargs)
    if registry.is_mutating(func):
        return mutation.run_mutating(func, args, kwargs)
    lowering = registry.get_lowering(func)
    if lowering is None:
        return fallback.run_without_lowering(func, args, kwargs)
    return run_lowering(lowering, func, args, kwargs)


_COMPOSITE_IMPLICIT: dict = {}


def _has_composite_implicit(func) -> bool:
    known = _COMPOSITE_IMPLICIT.get(func)
    if known is None:
        known = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd")
        _COMPOSITE_IMPLICIT[func] = known
    return known


# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------


def device_index_of(func, args, kwargs, leaves=None) -> int:
    """The one tpu device the op runs on; CUDA's error when tensors sit on several devices.

    0-dim CPU tensors are allowed beside tpu tensors (as CUDA allows them), nothing else is.
    """
    indices, foreign = set(), None
    for leaf in (leaves if leaves is not None else tree_flatten((args, kwargs))[0]):
        if isinstance(leaf, TpuTensor):
            indices.add(leaf.device.index)
        elif isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and foreign is None:
            foreign = leaf.device
    if len(indices) > 1:
        a, b = sorted(indices)[:2]
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"tpu:{a} and tpu:{b}! (when checking arguments for {func})")
    if not indices:
        raise RuntimeError(f"{func} reached the tpu device without a tpu tensor argument")
    index = indices.pop()
    if foreign is not None:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"tpu:{index} and {foreign}! (when checking arguments for {func})")
    return index


# ---------------------------------------------------------------------------------------------
# Meta: torch's own shape, dtype and error semantics
# ---------------------------------------------------------------------------------------------

_META_CACHE: dict = {}
_UNKNOWN = object()


def to_meta(value):
    if isinstance(value, torch.Tensor):
        if isinstance(value, TpuTensor):
            base = torch.empty(value._storage.numel, dtype=value.dtype, device="meta")
            return base.as_strided(value.shape, value.stride(), value.storage_offset())
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _meta_key(func, leaves):
    parts = [func]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.dtype, leaf.dim() == 0 and not isinstance(leaf, TpuTensor)))
        elif isinstance(leaf, (list, dict)):
            return None
        else:
            parts.append((type(leaf), leaf))
    return tuple(parts)


def meta_outputs(func, args, kwargs, leaves=None):
    """torch's meta result of ``func`` for these arguments (shapes, dtypes), or None when the
    op has no meta kernel (data-dependent shapes). Real errors (bad shapes, bad dtypes) raise,
    with torch's own message."""
    if leaves is None:
        leaves, _ = tree_flatten((args, kwargs))
    try:
        key = _meta_key(func, leaves)
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _META_CACHE:
        return _META_CACHE[key]
    try:
        result = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
    except (NotImplementedError, torch._subclasses.fake_tensor.DataDependentOutputException,
            torch._subclasses.fake_tensor.DynamicOutputShapeException):
        result = None
    except RuntimeError as error:
        if "meta" in str(error).lower() and ("not implemented" in str(error).lower()
                                             or "tensor.item()" in str(error)):
            result = None
        else:
            raise
    if key is not None:
        if len(_META_CACHE) > 50_000:
            _META_CACHE.clear()
        _META_CACHE[key] = result
    return result


# ---------------------------------------------------------------------------------------------
# Views
# ---------------------------------------------------------------------------------------------


def run_view(func, args, kwargs):
    """A view shares its base's storage; torch's meta kernel computes the geometry."""
    base = args[0]
    if not isinstance(base, TpuTensor):
        raise RuntimeError(f"view op {func} on a non-tpu base reached the tpu device")
    result = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))

    def as_view(meta):
        if not isinstance(meta, torch.Tensor):
            return meta
        if meta.dtype != base.dtype:
            raise NotImplementedError(
                f"{func} reinterprets {base.dtype} storage as {meta.dtype}: dtype-changing "
                f"views are not supported on the tpu device; use .to(dtype) (a copy) instead")
        return TpuTensor(base._storage, meta.shape, meta.stride(), meta.storage_offset())

    return tree_map(as_view, result)


# ---------------------------------------------------------------------------------------------
# Lowered ops
# ---------------------------------------------------------------------------------------------

_JIT_CACHE: dict = {}
_DYNAMIC = object()
# Ops whose float arguments decide output shapes: those floats must be compile-time constants.
_STATIC_FLOAT_OPS: set = set()
_SLOT_MASKS: dict = {}
# Ops whose lowering needs concrete values (data-dependent output shapes: nonzero,
# masked_select, boolean indexing): run without jit, on concrete arrays.
_CONCRETE_OPS: set = set()


class _Geometry(tuple):
    """Static description of a tpu tensor argument: its buffer is passed, its view is read
    inside the op's own jit (so an op costs one XLA dispatch, reads included)."""


class _AsArray(tuple):
    """A Python int/bool passed in a Tensor slot: becomes a weak 0-dim array in the trace."""


def _tensor_slot_mask(func, treedef, args, kwargs) -> tuple:
    """Per flattened leaf: does it sit in a ``Tensor``/``Tensor?`` slot of the schema?"""
    key = (func, treedef)
    mask = _SLOT_MASKS.get(key)
    if mask is None:
        by_name = {a.name: registry._is_tensor_slot(a) for a in func._schema.arguments}
        positional = [registry._is_tensor_slot(a) for a in func._schema.arguments]
        flags_args = [tree_map(lambda _, flag=positional[i] if i < len(positional) else False: flag, a)
                      for i, a in enumerate(args)]
        flags_kwargs = {k: tree_map(lambda _, flag=by_name.get(k, False): flag, v)
                        for k, v in kwargs.items()}
        mask = tuple(tree_flatten((flags_args, flags_kwargs))[0])
        _SLOT_MASKS[key] = mask
    return mask


def _split_leaves(func, leaves, slots, index, floats_static=False):
    """(dynamic values, static key) of flattened arguments. Tensors pass their raw buffers
    (their geometry is static); Python floats are dynamic too, so a learning rate that changes
    every step does not recompile."""
    dynamic, static = [], []
    floats_static = floats_static or func in _STATIC_FLOAT_OPS
    for leaf, in_tensor_slot in zip(leaves, slots):
        if isinstance(leaf, TpuTensor):
            dynamic.append(leaf._storage.buffer)
            static.append(_Geometry((tuple(leaf.shape), tuple(leaf.stride()),
                                     leaf.storage_offset())))
        elif isinstance(leaf, torch.Tensor):  # a 0-dim CPU tensor beside tpu tensors
            dynamic.append(jax.device_put(host_array(leaf), runtime.jax_device(index)))
            static.append(_DYNAMIC)
        elif isinstance(leaf, jax.Array):
            dynamic.append(leaf)
            static.append(_DYNAMIC)
        elif type(leaf) is float and not floats_static:
            dynamic.append(leaf)  # a weakly typed traced scalar inside the jit
            static.append(_DYNAMIC)
        elif isinstance(leaf, torch._C.Generator):
            # Not part of the program: its key is a dynamic argument (_random_key). PyTorch
            # re-wraps it per call, so keying the jit cache on it would compile every call.
            static.append(None)
        elif in_tensor_slot and isinstance(leaf, (bool, int, complex)):
            static.append(_AsArray((leaf,)))
        else:
            static.append(leaf)
    return dynamic, tuple(static)


def _compiled(lowering, func, treedef, static, out_dtypes, random):
    concrete = func in _CONCRETE_OPS
    key = (func, treedef, static, out_dtypes, random, concrete)
    cached = _JIT_CACHE.get(key)
    if cached is not None:
        return cached
    # The lowering's output structure (nested tuples/lists), recorded while tracing: it is
    # what ops without a meta kernel return.
    structure = {}

    def run(*dynamic_and_key):
        dynamic = dynamic_and_key[:-1] if random else dynamic_and_key
        values = iter(dynamic)
        leaves = []
        for entry in static:
            if entry is _DYNAMIC:
                leaves.append(next(values))
            elif type(entry) is _Geometry:
                leaves.append(storage_mod.read_in_trace(next(values), *entry))
            elif type(entry) is _AsArray:
                leaves.append(jax.numpy.asarray(entry[0]))
            else:
                leaves.append(entry)
        call_args, call_kwargs = tree_unflatten(leaves, treedef)
        if random:
            call_kwargs = dict(call_kwargs, rng_key=dynamic_and_key[-1])
        outputs = lowering.fn(*call_args, **call_kwargs)
        if out_dtypes is None:
            flat, out_tree = jax.tree_util.tree_flatten(outputs)
            structure["tree"] = out_tree
            structure["shapes"] = [tuple(a.shape) for a in flat]
            return [a.reshape(-1) for a in flat]
        # Keep None (an output the op was told not to compute) in place, so results line up
        # with torch's meta outputs.
        flat = jax.tree_util.tree_leaves(outputs, is_leaf=lambda x: x is None)
        if len(out_dtypes) != len(flat):
            raise RuntimeError(
                f"lowering of {func} returned {len(flat)} results, torch expects "
                f"{len(out_dtypes)}")
        results = []
        for a, d in zip(flat, out_dtypes):
            if a is not None and d is not None:
                a = jax.numpy.asarray(a)
                if a.dtype != storage_dtype(d):
                    a = a.astype(storage_dtype(d))
                a = a.reshape(-1)  # storages are flat; flattening inside the jit is free
            results.append(a)
        return results

    compiled = (run if concrete else jax.jit(run, compiler_options=runtime.compiler_options()),
                structure)
    _JIT_CACHE[key] = compiled
    return compiled


def run_lowering(lowering, func, args, kwargs):
    leaves, treedef = tree_flatten((args, kwargs))
    index = device_index_of(func, args, kwargs, leaves)
    meta = meta_outputs(func, args, kwargs, leaves)
    meta_leaves, meta_tree = tree_flatten(meta) if meta is not None else (None, None)
    out_dtypes = None
    if meta_leaves is not None:
        out_dtypes = tuple(m.dtype if isinstance(m, torch.Tensor) else None for m in meta_leaves)
    slots = _tensor_slot_mask(func, treedef, args, kwargs)
    dynamic, static = _split_leaves(func, leaves, slots, index, lowering.static_floats)
    fn, structure = _compiled(lowering, func, treedef, static, out_dtypes, lowering.random)
    if lowering.random:
        dynamic.append(_random_key(leaves, index))
    try:
        flat = fn(*dynamic)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
            jax.errors.TracerIntegerConversionError, jax.errors.TracerArrayConversionError,
            NotImplementedError) as error:
        if isinstance(error, NotImplementedError) and "compiled" not in str(error):
            raise
        if func in _CONCRETE_OPS:
            raise
        # First retry with float arguments as constants; if values still must be concrete,
        # the op runs eagerly without jit (it then cannot be part of a compiled step).
        (_STATIC_FLOAT_OPS if func not in _STATIC_FLOAT_OPS else _CONCRETE_OPS).add(func)
        return run_lowering(lowering, func, args, kwargs)
    if _sync:
        _wait(flat, func)
    if meta_leaves is None:
        return _wrap_unknown(flat, structure, index)
    results = []
    values = iter(flat)
    for m in meta_leaves:
        value = next(values)
        if isinstance(m, torch.Tensor):
            if value is None:  # not computed (e.g. a gradient masked off): never read
                value = jax.numpy.zeros((m.numel(),), storage_dtype(m.dtype),
                                        device=runtime.jax_device(index))
            results.append(TpuTensor(Storage(value, m.dtype, index), m.shape,
                                     contiguous_strides(m.shape), 0))
        else:
            results.append(value if value is None else _python_scalar(value))
    return tree_unflatten(results, meta_tree)


def _random_key(leaves, index):
    """The op's PRNG key: from its ``generator=`` argument when given, else the device's
    default stream."""
    for leaf in leaves:
        if isinstance(leaf, torch._C.Generator):
            return generator.key_from_generator(leaf, index)
    return rng.next_key(index)


def _python_scalar(value):
    return jax.device_get(value).item()


def _wrap_unknown(flat, structure, index):
    """Outputs of ops without a meta kernel: trust the lowering's shapes and structure and map
    dtypes back (int32 is how int64 is stored, so integer results are reported as int64,
    torch's index type)."""
    from tpu_train.ops.dtypes import torch_dtype

    wrapped = []
    for value, shape in zip(flat, structure["shapes"]):
        dtype = torch_dtype(value.dtype)
        if dtype == torch.int32:
            dtype = torch.int64
        wrapped.append(TpuTensor(Storage(value, dtype, index), shape, contiguous_strides(shape), 0))
    return jax.tree_util.tree_unflatten(structure["tree"], wrapped)


def _wait(values, func):
    try:
        jax.block_until_ready(values)
    except Exception as error:  # noqa: BLE001 - re-raised with the op that failed
        raise RuntimeError(f"tpu op {func} failed on the device: {error}") from error
