"""The eager op call path: one key per call, everything derived from it cached together.

An eager op used to cost ~100 µs of Python before its executable ran (four pytree flattens, a
schema walk, meta and jit cache look-ups, eager reshapes around it). Here one pass over the
arguments builds one key and collects the values the op's executable takes (each tpu tensor's
raw storage buffer, Python floats, 0-dim CPU tensors). An *entry* per key holds all that is
derived from it: the device (checked, with torch's errors, on the key's first call), torch's
meta result (output shapes and dtypes: PyTorch's promotion and shape errors were raised on the
first call), the jitted executable, and how its outputs become tensors. The executable reads each
tensor argument's view from its flat buffer, runs the lowering, casts to torch's dtypes and
flattens the outputs; for in-place and ``out=`` ops (:mod:`tpu_train.device.inplace`) it also
writes the result through the destination's geometry. An op is one XLA dispatch, and a repeated
call does no meta work.

Key: ``(op, part per positional argument, _KWARGS, name, part, name, part, ...)`` where ``op``
is the op's :class:`OpInfo` and a part is

* a tpu tensor: its ``key_part``, ``(size, stride, storage_offset, dtype, device_index)``; the
  size in front (a tuple or ``torch.Size``: no other part starts with one) tells it apart from
  every other part; its buffer is an executable input;
* a Python float: the type ``float`` (the value is an input: a learning rate that changes every
  step does not recompile), or ``(float, value.hex())`` for ops whose floats must be constants;
* an int, bool or complex: ``(type, value)``, baked in (the type keeps ``True`` and ``1`` apart);
* a list or tuple: ``(_INTS, type, values)`` when all its items are ints (sizes, dims), else
  ``(_SEQ, type, *parts)``; a 0-dim CPU tensor: ``(_HOST, dtype)``, its value
  an input; a generator: ``_GENERATOR`` (random ops draw a fresh PRNG key per call, from it or
  from the device's stream: a key is never cached);
* anything else (None, dtypes, devices, strings): itself.

Views are keyed the same way (plus the base's storage size, which bounds ``as_strided``) and
cache only their output geometries. Ops whose output shapes depend on values (nonzero,
masked_select, unique) cache their executable, not their shapes. In fused eager mode
(:mod:`tpu_train.device.lazy`) an entry records ``(executable, inputs)`` instead of calling it.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tpu_train.device import dispatch_thread, generator, lazy, mutation, rng, runtime, scalars
from tpu_train.device import storage as storage_mod
from tpu_train.device.meta import device_index_of, meta_outputs, to_meta
from tpu_train.device.storage import Storage, contiguous_strides
from tpu_train.device.tensor import (TpuTensor, current_key_part, host_array,
                                    new_contiguous_tensor, new_tensor)
from tpu_train.ops import registry
from tpu_train.ops.dtypes import storage_dtype

SYNC_ENV = "TPU_TRAIN_SYNC"
# A self-check for the device layer's own tests: every tensor argument's cached key part is
# compared with its geometry as PyTorch reports it (a change of geometry that skipped
# ``refresh_key_part`` would otherwise run an executable built for the old one).
VERIFY_KEY_PARTS_ENV = "TPU_TRAIN_VERIFY_KEY_PARTS"
_verify_key_parts = os.environ.get(VERIFY_KEY_PARTS_ENV, "") not in ("", "0")
_sync_from_environment = os.environ.get(SYNC_ENV, "") not in ("", "0")
_sync = _sync_from_environment
# Strict mode records multi-tensor ops into its device's region (lazy.batch_multi_tensor); never
# when every op must wait (debug mode, TPU_TRAIN_SYNC=1).
batch = not _sync


def _follow_mode(name: str) -> None:
    global _sync, batch
    _sync = _sync_from_environment or name == lazy.DEBUG
    batch = lazy.batch_multi_tensor and not _sync


lazy.on_mode_change(_follow_mode)

_SEQ, _INTS, _HOST, _GENERATOR, _KWARGS = (object() for _ in range(5))
_PLAIN_NUMBERS = (int, bool, complex)
_ENTRIES: dict = {}
_MAX_ENTRIES = 50_000


class Unkeyable(Exception):
    """An argument the key cannot describe (a CPU tensor with dims: a device error)."""


# ---------------------------------------------------------------------------------------------
# The key: one pass over the arguments
# ---------------------------------------------------------------------------------------------


def call_key(head, args, kwargs, static_floats, dynamic, tensors) -> tuple:
    """The call's key, starting with ``head``, the op's :class:`OpInfo` (hashing a key hashes
    its head: an ``OpOverload``'s ``__hash__`` is a Python function, an OpInfo's is C's);
    appends the executable's inputs to ``dynamic`` (None: views, which take none) and the tpu
    tensor arguments, in order, to ``tensors``."""
    parts = [head]
    append = parts.append
    for value in args:
        if type(value) is TpuTensor:  # inline: the common case
            if _verify_key_parts:
                verify_key_part(value)
            if dynamic is not None:
                dynamic.append(value._storage.lazy_buffer)
            tensors.append(value)
            append(value.key_part)
        else:
            append(_part(value, static_floats, dynamic, tensors))
    if kwargs:
        append(_KWARGS)
        for name, value in kwargs.items():
            append(name)
            append(_part(value, static_floats, dynamic, tensors))
    return tuple(parts)


def _part(value, static_floats, dynamic, tensors):
    cls = type(value)
    if cls is float:
        if static_floats:
            return (float, value.hex())  # hex: -0.0 and nan are keyed exactly
        if dynamic is not None:
            dynamic.append(value)
        return float
    if value is None:
        return None
    if cls in _PLAIN_NUMBERS:
        return (cls, value)
    if cls is list or cls is tuple or cls is torch.Size:
        # A loop, not all() over a generator: a generator is a Python call per item.
        for item in value:
            if type(item) is not int:
                return (_SEQ, cls) + tuple([_part(v, static_floats, dynamic, tensors)
                                            for v in value])
        return (_INTS, cls, tuple(value))  # sizes and dims: most sequences
    if isinstance(value, TpuTensor):
        if _verify_key_parts:
            verify_key_part(value)
        if dynamic is not None:
            dynamic.append(value._storage.lazy_buffer)
        tensors.append(value)
        return value.key_part
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.device.type != "cpu":
            raise Unkeyable
        if dynamic is not None:
            dynamic.append(host_array(value))
        return (_HOST, value.dtype)
    if isinstance(value, torch._C.Generator):
        return _GENERATOR
    return value


def verify_key_part(tensor: TpuTensor) -> None:
    actual = current_key_part(tensor)
    if tensor.key_part != actual:
        raise RuntimeError(f"internal error: a tpu tensor's geometry changed without "
                           f"refresh_key_part: keyed as {tensor.key_part}, is {actual}")


# ---------------------------------------------------------------------------------------------
# Per-op facts
# ---------------------------------------------------------------------------------------------

LOWERED, VIEW, COMPOSITE_VIEW, INPLACE_VIEW, MUTATING, UNLOWERED = (
    "lowered", "view", "composite_view", "inplace_view", "mutating", "unlowered")


class OpInfo:
    """What ``dispatch`` needs to know about an op, worked out once (and again whenever the
    lowering table changes)."""

    __slots__ = ("kind", "lowering", "functional", "static_floats", "concrete",
                 "positional_slots", "keyword_slots", "multi_dest", "multi_tensor")

    def __init__(self, func, kind, lowering=None, functional=None):
        self.kind, self.lowering, self.functional = kind, lowering, functional
        # A ``_foreach_*`` op: strict mode batches runs of them into one program.
        self.multi_tensor = func._schema.name.startswith("aten::_foreach_")
        self.static_floats = bool(lowering is not None and lowering.static_floats)
        self.concrete = False  # the lowering needs concrete values: run without jit
        arguments = func._schema.arguments
        self.positional_slots = tuple(registry._is_tensor_slot(a) for a in arguments)
        self.keyword_slots = frozenset(a.name for a in arguments if registry._is_tensor_slot(a))
        written = [a for a in arguments if a.alias_info is not None and a.alias_info.is_write]
        # A written Tensor[] (schema type List[Tensor], e.g. split_with_sizes_copy's out=)
        # holds several destinations, which may be views of one storage.
        self.multi_dest = len(written) > 1 or any(isinstance(a.type, torch.ListType)
                                                  for a in written)


_INFO: dict = {}


def op_info(func) -> OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = _classify(func)
    return info


def _classify(func) -> OpInfo:
    if func is torch.ops.aten._unsafe_view.default:
        # PyTorch's _unsafe_view shares its input's storage (a view autograd does not track;
        # matmul reshapes its fresh product with it): geometry only, never a copy.
        return OpInfo(func, VIEW)
    if torch.Tag.inplace_view in func.tags:
        return OpInfo(func, INPLACE_VIEW)
    if func.is_view:
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd")
        return OpInfo(func, COMPOSITE_VIEW if composite else VIEW)
    if registry.is_mutating(func):
        functional = mutation.functional_variant(func)
        lowering = registry.get_lowering(functional) if functional is not None else None
        return OpInfo(func, MUTATING, lowering, functional)
    lowering = registry.get_lowering(func)
    return OpInfo(func, LOWERED if lowering is not None else UNLOWERED, lowering)


def _forget_everything() -> None:
    _INFO.clear()
    _ENTRIES.clear()


registry.on_change(_forget_everything)


def remember(key, entry) -> None:
    if len(_ENTRIES) >= _MAX_ENTRIES:
        _ENTRIES.clear()
    _ENTRIES[key] = entry


# ---------------------------------------------------------------------------------------------
# Inside the executable: arguments from the key and the inputs
# ---------------------------------------------------------------------------------------------


class Ref:
    """A tensor argument while planning an in-place op: its input position, which tensor
    argument it is, and its view."""

    __slots__ = ("slot", "ordinal", "geometry")

    def __init__(self, slot, ordinal, geometry):
        self.slot, self.ordinal, self.geometry = slot, ordinal, geometry


class Decoder:
    """Rebuilds ``(args, kwargs)`` from a key: with traced inputs (tensors become their views'
    values, read from the flat buffers), or with ``inputs=None`` (tensors become :class:`Ref`)."""

    def __init__(self, info: OpInfo, inputs):
        self.info, self.inputs, self.slot, self.ordinal = info, inputs, 0, 0

    def call(self, key):
        args, kwargs, slots = [], {}, self.info.positional_slots
        i = 1
        while i < len(key) and key[i] is not _KWARGS:
            args.append(self.value(key[i], i - 1 < len(slots) and slots[i - 1]))
            i += 1
        for name, part in zip(key[i + 1::2], key[i + 2::2]):
            kwargs[name] = self.value(part, name in self.info.keyword_slots)
        return args, kwargs

    def _next(self):
        self.slot += 1
        return None if self.inputs is None else self.inputs[self.slot - 1]

    def value(self, part, tensor_slot):
        if part is float:
            return self._next()
        if part is _GENERATOR:
            return None  # not part of the program: the PRNG key is an input (rng_key)
        if type(part) is not tuple:
            return part
        head = part[0]
        if type(head) is tuple or type(head) is torch.Size:
            geometry = (tuple(head), part[1], part[2])
            self.ordinal += 1
            if self.inputs is None:
                self.slot += 1
                return Ref(self.slot - 1, self.ordinal - 1, geometry)
            return storage_mod.read_in_trace(self._next(), *geometry)
        if head is _INTS:
            return list(part[2]) if part[1] is list else part[1](part[2])
        if head is _SEQ:
            items = [self.value(p, False) for p in part[2:]]
            return items if part[1] is list else part[1](items)
        if head is _HOST:
            return self._next()
        if head is float:
            return float.fromhex(part[1])
        # A Python number in a Tensor slot is a weakly typed 0-dim array (torch's wrapped
        # number promotion); elsewhere it stays a Python value.
        return jnp.asarray(part[1]) if tensor_slot else part[1]


def cast_leaves(func, outputs, specs) -> list:
    """The lowering's results as a flat list lined up with torch's meta leaves (``None`` kept in
    place), each tensor cast to the storage dtype of torch's dtype."""
    flat = jax.tree_util.tree_leaves(outputs, is_leaf=lambda x: x is None)
    if len(flat) != len(specs):
        raise RuntimeError(f"lowering of {func} returned {len(flat)} results, torch expects "
                           f"{len(specs)}")
    results = []
    for a, spec in zip(flat, specs):
        if spec is not None:
            shape, dtype = spec
            target = storage_dtype(dtype)
            # None: an output the op was told not to compute (a masked-off gradient); never read.
            a = jnp.zeros(shape, target) if a is None else jnp.asarray(a)
            if a.dtype != target:
                a = a.astype(target)
        results.append(a)
    return results


def _lowered_program(info: OpInfo, func, key, specs):
    """The op's executable: inputs → flat output buffers; the Python function it jits (what a
    fused-mode region traces); and the output structure it records while tracing (what ops
    without a meta kernel return)."""
    structure = {}
    lowering = info.lowering

    def run(*inputs):
        args, kwargs = Decoder(info, inputs).call(key)
        if lowering.random:
            kwargs["rng_key"] = inputs[-1]
        outputs = lowering.fn(*args, **kwargs)
        if specs is None:
            flat, structure["tree"] = jax.tree_util.tree_flatten(outputs)
            structure["shapes"] = [tuple(a.shape) for a in flat]
            return [a.reshape(-1) for a in flat]
        # Storages are flat; flattening inside the jit is free.
        return [a if spec is None else a.reshape(-1)
                for a, spec in zip(cast_leaves(func, outputs, specs), specs)]

    if info.concrete:
        return run, run, structure
    return jax.jit(run, compiler_options=runtime.op_program_options()), run, structure


# ---------------------------------------------------------------------------------------------
# Outputs on the host
# ---------------------------------------------------------------------------------------------


def new_output(buffer, dtype, index, shape, strides) -> TpuTensor:
    return new_tensor(Storage(buffer, dtype, index), shape, strides)


def _python_value(value):
    return None if value is None else jax.device_get(value).item()


def _output_plan(meta):
    """(per meta leaf: (shape, dtype) or None for a non-tensor, and a builder turning the
    executable's flat buffers into torch's result) for torch's meta result ``meta``."""
    if isinstance(meta, torch.Tensor):
        shape, dtype = tuple(meta.shape), meta.dtype
        strides = contiguous_strides(shape)
        return ((shape, dtype),), lambda flat, index: new_output(flat[0], dtype, index, shape,
                                                              strides)
    leaves, tree = tree_flatten(meta)
    specs = tuple((tuple(m.shape), m.dtype) if isinstance(m, torch.Tensor) else None
                  for m in leaves)
    layouts = [None if s is None else (s[1], s[0], contiguous_strides(s[0])) for s in specs]
    sequence = type(meta) if type(meta) in (tuple, list) and not any(
        isinstance(m, (tuple, list, dict)) for m in meta) else None

    def build(flat, index):
        results = [_python_value(v) if layout is None
                   else new_output(v, layout[0], index, layout[1], layout[2])
                   for v, layout in zip(flat, layouts)]
        return sequence(results) if sequence is not None else tree_unflatten(results, tree)

    return specs, build


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


def random_key(args, kwargs, index):
    """The op's PRNG key, fresh per call: from its ``generator=`` argument when given, else the
    device's default stream."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch._C.Generator):
            return generator.key_from_generator(value, index)
    return rng.next_key(index)


def wait(values, func):
    try:
        jax.block_until_ready(values)
    except Exception as error:  # noqa: BLE001 - re-raised with the op that failed
        raise RuntimeError(f"tpu op {func} failed on the device: {error}") from error


# ---------------------------------------------------------------------------------------------
# Functional ops
# ---------------------------------------------------------------------------------------------

# Raised while tracing when a lowering needs values: retry with constant floats, then without jit.
NEEDS_VALUES = (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
                 jax.errors.TracerIntegerConversionError, jax.errors.TracerArrayConversionError,
                 NotImplementedError)


class _Lowered:
    __slots__ = ("func", "fn", "body", "index", "random", "build", "structure", "single",
                 "out_avals", "float_slots", "multi_tensor")

    def __init__(self, func, fn, body, index, random, build, structure, meta, specs, jitted,
                 multi_tensor=False):
        self.func, self.fn, self.body, self.index, self.random = func, fn, body, index, random
        self.multi_tensor = multi_tensor
        self.build, self.structure = build, structure
        # One tensor result (most ops): built inline, its size in bytes known in advance.
        self.single = None
        if isinstance(meta, torch.Tensor):
            shape = tuple(meta.shape)
            self.single = (meta.dtype, shape, contiguous_strides(shape),
                           meta.numel() * meta.element_size())
        # The flat buffers' shapes and dtypes, where fused mode can record the op: a jitted
        # executable whose results are all tensors of known shape.
        self.out_avals = None
        if jitted and build is not None and all(spec is not None for spec in specs):
            self.out_avals = tuple(flat_aval(shape, dtype) for shape, dtype in specs)
        self.float_slots = None if jitted else ()  # found on the first call (the inputs)

    def __call__(self, args, kwargs, inputs, tensors, first=False):
        if self.random:
            inputs.append(random_key(args, kwargs, self.index))
        if lazy.active or (batch and (self.multi_tensor or lazy.records_backward())):
            if dispatch_thread.enabled:
                dispatch_thread.resolve(inputs)
            if self.out_avals is not None and not first:  # _fused's common case, inline
                flat = lazy.region(self.index).record(self.body, inputs, self.out_avals)
                if flat is None:
                    flat = self.fn(*lazy.concrete(inputs))
            else:
                flat = self._fused(inputs, first)
        else:
            if self.float_slots != ():
                scalars.place_floats(inputs, self)
            if dispatch_thread.enabled:
                if self.out_avals is not None and not first and not _sync:
                    flat = dispatch_thread.issue(self.fn, inputs, self.out_avals, self.func)
                else:
                    dispatch_thread.resolve(inputs)
                    flat = self.fn(*inputs)
            else:
                flat = self.fn(*inputs)
            if _sync:
                wait(flat, self.func)
        if self.single is not None:
            dtype, shape, strides, nbytes = self.single
            return new_contiguous_tensor(Storage(flat[0], dtype, self.index, nbytes), shape,
                                         strides)
        if self.build is None:
            return _wrap_unknown(flat, self.structure, self.index)
        return self.build(flat, self.index)

    def _fused(self, inputs, first):
        if self.out_avals is None:
            return self.fn(*lazy.concrete(inputs))
        if first:  # a lowering that needs values fails here, not when the region runs
            jax.eval_shape(self.fn, *[lazy.aval_of(v) for v in inputs])
        recorded = lazy.region(self.index).record(self.body, inputs, self.out_avals)
        return self.fn(*lazy.concrete(inputs)) if recorded is None else recorded


def flat_aval(shape, dtype) -> tuple:
    """(shape, dtype) of the flat buffer holding a tensor of ``shape`` and torch ``dtype``."""
    numel = 1
    for n in shape:
        numel *= n
    return (numel,), numpy.dtype(storage_dtype(dtype))


def run_lowered(info: OpInfo, func, args, kwargs):
    inputs, tensors = [], []
    try:
        key = call_key(info, args, kwargs, info.static_floats, inputs, tensors)
        entry = _ENTRIES.get(key)
    except (Unkeyable, TypeError):
        device_index_of(func, args, kwargs)  # the device error it usually is
        raise TypeError(f"{func}: an argument the tpu device cannot pass to a lowering") from None
    if entry is not None:
        return entry(args, kwargs, inputs, tensors)
    index = device_index_of(func, args, kwargs)
    specs, build = _output_plan(meta) if (meta := meta_outputs(func, args, kwargs)) is not None \
        else (None, None)
    fn, body, structure = _lowered_program(info, func, key, specs)
    entry = _Lowered(func, fn, body, index, info.lowering.random, build, structure, meta, specs,
                     not info.concrete, info.multi_tensor)
    try:
        result = entry(args, kwargs, inputs, tensors, first=True)
    except NEEDS_VALUES as error:
        if isinstance(error, NotImplementedError) and "compiled" not in str(error):
            raise
        if info.concrete:
            raise
        # First retry with float arguments as constants; if values still must be concrete,
        # the op runs eagerly without jit (it then cannot be part of a compiled step).
        if info.static_floats:
            info.concrete = True
        info.static_floats = True
        return run_lowered(info, func, args, kwargs)
    remember(key, entry)
    return result


# ---------------------------------------------------------------------------------------------
# Views: geometry only
# ---------------------------------------------------------------------------------------------


def view_result(func, args, kwargs):
    """A view shares its base's storage; torch's meta kernel computes the geometry."""
    base = args[0]
    if not isinstance(base, TpuTensor):
        raise RuntimeError(f"view op {func} on a non-tpu base reached the tpu device")
    result = func(*torch.utils._pytree.tree_map(to_meta, args),
                  **torch.utils._pytree.tree_map(to_meta, kwargs))

    def as_view(meta):
        if not isinstance(meta, torch.Tensor):
            return meta
        if meta.dtype != base.dtype:
            raise NotImplementedError(
                f"{func} reinterprets {base.dtype} storage as {meta.dtype}: dtype-changing "
                f"views are not supported on the tpu device; use .to(dtype) (a copy) instead")
        return TpuTensor(base._storage, meta.shape, meta.stride(), meta.storage_offset())

    return torch.utils._pytree.tree_map(as_view, result)


def run_view(info: OpInfo, func, args, kwargs):
    tensors = []
    try:
        # The base's storage size belongs to the key: it bounds what as_strided may address.
        key = (call_key(info, args, kwargs, True, None, tensors), args[0]._storage.numel)
        entry = _ENTRIES.get(key)
    except (Unkeyable, TypeError, AttributeError, IndexError):
        return view_result(func, args, kwargs)
    if entry is not None:
        return entry(args[0]._storage)
    result = view_result(func, args, kwargs)
    entry = _view_entry(result)
    if entry is not None:
        remember(key, entry)
    return result


def _view_entry(result):
    if isinstance(result, TpuTensor):
        shape, stride, offset = result.shape, result.stride(), result.storage_offset()
        if offset == 0 and stride == contiguous_strides(shape):  # view, reshape, unsqueeze...
            return lambda storage: new_contiguous_tensor(storage, shape, stride)
        return lambda storage: new_tensor(storage, shape, stride, offset)
    if type(result) in (list, tuple) and all(isinstance(r, TpuTensor) for r in result):
        kind = type(result)
        geometries = [(r.shape, r.stride(), r.storage_offset()) for r in result]
        return lambda storage: kind([new_tensor(storage, *g) for g in geometries])
    return None
