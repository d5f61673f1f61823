"""Emulated strided memory: one flat JAX buffer per storage, shared by all its views.

(A compiled step may leave a storage's buffer in its tensor's natural shape: on a TPU a flat
buffer and a 2-D one are laid out differently in memory, and converting costs a copy per
parameter per step. Whole-tensor reads take it as it is; anything else flattens it once.)

JAX arrays are immutable, so a PyTorch storage is modelled as a mutable holder of a flat
buffer. A tensor is (storage, size, stride, offset), exactly as on a real device:

* reading a tensor gathers its elements from the buffer. The geometry is decomposed into a
  contiguous range + reshape + static slices + transpose + broadcast whenever possible (the
  common views: transpose, narrow, select, step slices, diagonal, expand), so XLA sees cheap
  slicing, never a generic gather; only truly irregular geometries (overlapping unfold windows,
  odd ``as_strided``) fall back to an index gather;
* writing a tensor scatters the new values into the buffer and swaps the storage's buffer, so
  the base and every sibling view see the write. A write covering the whole storage
  contiguously just replaces the buffer.

Readers and writers are jitted per geometry and cached.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpu_train.device import dispatch_thread, lazy, runtime, scalars
from tpu_train.device.dispatch_thread import Issued
from tpu_train.device.lazy import Pending
from tpu_train.ops.dtypes import storage_dtype

Geometry = tuple  # (size tuple, stride tuple, offset int)


class Storage:
    """A flat device buffer holding ``numel`` elements of a torch dtype on one device."""

    __slots__ = ("_buffer", "_pending", "_unusual", "_numel", "dtype", "device_index", "_held",
                 "__weakref__")

    def __init__(self, buffer: jax.Array, dtype: torch.dtype, device_index: int,
                 nbytes: int | None = None):
        """``nbytes``: the size in bytes when the caller knows it (an op output whose shape is
        cached), saving the look-ups on the buffer."""
        self._numel = None  # known once asked (views key by it), until the buffer is replaced
        if nbytes is None:
            shape = buffer.shape
            assert len(shape) == 1, shape
            self._numel = shape[0]
            nbytes = shape[0] * _element_size(dtype)
        self._buffer = buffer
        self._pending = None
        # True while the buffer may not be a flat jax.Array (a pending copy, a fused-mode
        # Pending, a dispatch thread's Issued, a compiled step's natural shape): lazy_buffer
        # then takes its slow path. An op reads every input through lazy_buffer, and asking a
        # jax.Array its ndim is a Python property call.
        self._unusual = type(buffer) in _DEFERRED
        self.dtype = dtype
        self.device_index = device_index
        # Every op output creates a Storage: accounting is two integer updates, and __del__
        # (not weakref.finalize, which costs a few µs per object) gives the bytes back.
        self._held = nbytes
        with _lock:  # _adjust's update, inline: one call less per op output
            live = _live[device_index] = _live.get(device_index, 0) + nbytes
            if live > _peak.get(device_index, 0):
                _peak[device_index] = live

    @classmethod
    def unfilled(cls, numel: int, dtype: torch.dtype, device_index: int) -> "Storage":
        """``torch.empty``'s storage: its buffer (zeros, the deterministic stand-in for torch's
        uninitialised memory) is made when something first reads it. A tensor overwritten
        whole first, as ``.to("tpu")`` and ``module.to("tpu")`` overwrite the ``empty`` they
        make, never runs or records a fill, nor copies zeros from the host."""
        storage = cls(None, dtype, device_index, numel * _element_size(dtype))
        storage._numel = numel
        storage.fill_later(_FillOnRead(numel, dtype, device_index))
        storage._unusual = True  # lazy_buffer's slow path makes the fill
        return storage

    @classmethod
    def whole(cls, array: jax.Array, dtype: torch.dtype, device_index: int) -> "Storage":
        """A storage of ``array`` in whatever shape it has: a whole tensor's buffer, flat or in
        the tensor's own shape (as a compiled step leaves parameters on a TPU)."""
        numel = math.prod(array.shape)
        storage = cls(array, dtype, device_index, numel * _element_size(dtype))
        storage._numel = numel
        storage._unusual = True  # lazy_buffer flattens a shaped buffer on first read
        return storage

    def __del__(self):
        try:
            with _lock:
                _live[self.device_index] -= self._held
        except (AttributeError, TypeError, KeyError):  # half-built, or interpreter shutdown
            pass

    def _resolved(self):
        """The buffer in whatever shape it has (module docstring), after any host-to-device
        copy in flight (:meth:`fill_later`) and the fused-mode region that computes it
        (:mod:`tpu_train.device.lazy`)."""
        if self._pending is not None:
            self._buffer = self._pending.result()
            self._pending = None
        buffer = self._buffer
        if type(buffer) is Pending:
            buffer = self._buffer = buffer.value()
        elif type(buffer) is Issued:
            buffer = self._buffer = dispatch_thread.value(buffer)
        return buffer

    def as_stored(self) -> jax.Array:
        """The whole buffer in whatever shape it has now (flat, or a compiled step's natural
        shape), after any copy in flight or fused-mode region that computes it: for a
        consumer that reshapes it itself, where :attr:`buffer` or :meth:`shaped` would run a
        reshape program (a copy on a TPU)."""
        return self._resolved()

    @property
    def buffer(self) -> jax.Array:
        """The flat buffer; waits for a host-to-device copy still in flight (:meth:`fill_later`)
        and runs the fused-mode region that computes it (:mod:`tpu_train.device.lazy`). A
        buffer a compiled step left in its natural shape is flattened once here."""
        buffer = self._buffer
        if self._pending is not None or type(buffer) in _DEFERRED:
            buffer = self._resolved()
        if len(buffer.shape) != 1:
            buffer = self._buffer = buffer.reshape(-1)
        return buffer

    def shaped(self, shape: tuple) -> jax.Array:
        """The whole buffer as an array of ``shape`` (same elements, row-major): as it is when
        it already has that shape, else reshaped (a copy on a TPU, whose tiled layouts make
        flat and 2-D arrays different in memory), and the storage keeps the reshaped buffer,
        so that the next whole read (a compiled step's every call) costs nothing."""
        buffer = self._resolved()
        if buffer.shape != shape:
            buffer = self._buffer = buffer.reshape(shape)
        self._unusual = True
        return buffer

    @property
    def sharding(self):
        """Where the buffer lives (a ``jax.sharding.Sharding``), whatever its shape."""
        return self._resolved().sharding

    @property
    def lazy_buffer(self):
        """The flat buffer, or in fused mode the :class:`~tpu_train.device.lazy.Pending` value
        that will become it, without running anything: what an op being recorded takes."""
        buffer = self._buffer
        if self._unusual:
            if type(buffer) is Pending and buffer.array is None and self._pending is None:
                return buffer  # fused mode's usual input, an earlier op's result: as it is
            return self._unusual_lazy_buffer()
        return buffer

    def _unusual_lazy_buffer(self):
        if self._pending is not None:
            self._buffer = self._pending.result()
            self._pending = None
        buffer = self._buffer
        if type(buffer) in _DEFERRED and buffer.array is not None:
            buffer = self._buffer = buffer.array
        if type(buffer) in _DEFERRED:
            return buffer  # an Issued one with a failure: its reader raises it
        if buffer.ndim != 1:
            buffer = self._buffer = buffer.reshape(-1)
        self._unusual = False
        return buffer

    @buffer.setter
    def buffer(self, value: jax.Array) -> None:
        """Replace the whole buffer: flat, or any shape with the storage's element count (a
        compiled step on a TPU returns parameters in their natural shapes)."""
        self._pending = None  # a full overwrite: an unfinished copy's result is not wanted
        self._buffer = value
        self._unusual = True  # the next lazy_buffer checks it (once)
        self._numel = None

    def fill_later(self, future) -> None:
        """Take the whole buffer from ``future`` (a ``concurrent.futures.Future`` of a flat
        array of this size) when it is first read: an asynchronous host-to-device copy."""
        self._pending = future

    def defer(self, source) -> None:
        """Replace the whole buffer with ``source.result()`` (an object with ``result()`` and
        ``done()``, as :meth:`fill_later`'s futures), made when first read; the current buffer
        is dropped now. A compiled step that holds a scanned stack's layers in one stacked
        array leaves each layer's storage its element of it this way."""
        numel = self.numel
        self._pending = source
        self._buffer = None
        self._numel = numel
        self._unusual = True

    @property
    def ready(self) -> bool:
        """False while a copy started by :meth:`fill_later` has not finished."""
        return self._pending is None or self._pending.done()

    def resize(self, numel: int) -> None:
        """Give the storage a buffer of ``numel`` elements (contents kept up to the shorter
        length, the rest zero), keeping the memory accounting right: FSDP2 frees and
        re-allocates unsharded parameters this way."""
        old = self.numel
        if numel == old:
            return
        kept = min(old, numel)
        buffer = jnp.zeros((numel,), self.buffer.dtype, device=next(iter(self.buffer.devices())))
        if kept:
            buffer = buffer.at[:kept].set(self.buffer[:kept])
        self.buffer = buffer
        self._numel = numel
        global _resizes
        _resizes += 1
        delta = (numel - old) * _element_size(self.dtype)
        self._held += delta
        _adjust(self.device_index, delta)

    @property
    def numel(self) -> int:
        # A pending copy has the same size: no need to wait.
        numel = self._numel
        if numel is None:
            numel = self._numel = math.prod(self._buffer.shape)
        return numel

    @property
    def nbytes(self) -> int:
        return self.numel * _element_size(self.dtype)


# Buffers still being computed: a fused region's result, a dispatch thread's call.
_DEFERRED = (Pending, Issued)
# At most this many bytes reshaped by one program of shape_whole: the old flat buffers and the
# new shaped ones both live until it has run.
_SHAPE_WHOLE_BYTES = 1 << 30


def shape_whole(storages: list, shapes: list) -> None:
    """Give each storage its whole buffer in the matching shape (as :meth:`Storage.shaped`
    does one by one), reshaping every buffer that needs it with one program per device and
    at most ~1 GiB: on a TPU each reshape is a copy and, one by one, a program to compile per
    shape (~0.1-1.5 s each on a v5e), which a compiled step's first call and the first
    validation pay for every parameter and optimizer-state shape. The caller's reads of
    ``shaped`` are then free."""
    groups: dict = {}
    for storage, shape in zip(storages, shapes):
        buffer = storage._resolved()
        if type(buffer) in _DEFERRED or buffer.shape == tuple(shape):
            continue
        sharding = buffer.sharding
        if not isinstance(sharding, jax.sharding.SingleDeviceSharding):
            continue  # spread over devices: shaped() one by one, as before
        groups.setdefault(sharding, []).append((storage, buffer, tuple(shape)))
    for sharding, members in groups.items():
        chunk, size = [], 0
        for member in members:
            chunk.append(member)
            size += member[1].nbytes
            if size >= _SHAPE_WHOLE_BYTES:
                _reshape_together(chunk, sharding)
                chunk, size = [], 0
        if chunk:
            _reshape_together(chunk, sharding)


def _reshape_together(members: list, sharding) -> None:
    if len(members) == 1:
        return  # shaped() reshapes it: the same one program
    shapes = tuple(shape for _, _, shape in members)
    values = _reshaper(shapes, sharding)(*[buffer for _, buffer, _ in members])
    for (storage, _, _), value in zip(members, values):
        storage.buffer = value


@functools.lru_cache(maxsize=256)
def _reshaper(shapes: tuple, sharding):
    return jax.jit(lambda *buffers: [b.reshape(s) for b, s in zip(buffers, shapes)],
                   out_shardings=[sharding] * len(shapes),
                   compiler_options=runtime.op_program_options())
_ELEMENT_SIZES: dict = {}
_resizes = 0


def resize_count() -> int:
    """How many times any storage changed its size (:meth:`Storage.resize`): what a caller
    that keeps facts about storages (a compiled step's donation decisions) checks."""
    return _resizes


def _element_size(dtype: torch.dtype) -> int:
    size = _ELEMENT_SIZES.get(dtype)
    if size is None:
        size = _ELEMENT_SIZES[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


# Live and peak bytes of device storages per device, for ``torch.tpu.memory_*`` (used where
# the PJRT backend reports no memory statistics: the CPU client). The lock is re-entrant: a
# storage may die (``__del__``) inside a garbage collection that runs while this thread holds it.
_lock = threading.RLock()
_live: dict[int, int] = {}
_peak: dict[int, int] = {}


def _adjust(index: int, delta: int) -> None:
    with _lock:
        live = _live[index] = _live.get(index, 0) + delta
        if live > _peak.get(index, 0):
            _peak[index] = live


def allocated_bytes(index: int) -> int:
    return _live.get(index, 0)


def peak_allocated_bytes(index: int) -> int:
    return _peak.get(index, 0)


def reset_peak(index: int) -> None:
    with _lock:
        _peak[index] = _live.get(index, 0)


def is_contiguous(size, stride) -> bool:
    expected = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def contiguous_strides(size) -> tuple:
    strides, running = [], 1
    for n in reversed(size):
        strides.append(running)
        running *= max(n, 1)
    return tuple(reversed(strides))


# ---------------------------------------------------------------------------------------------
# Geometry → slicing plan
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _box_plan(size: tuple, stride: tuple, offset: int, storage_numel: int):
    """Express a strided view as: a contiguous range of the buffer, reshaped to a dense box,
    sliced to the view's extents, transposed to the view's dim order and broadcast over its
    stride-0 dims. Returns None when the geometry does not fit that form (overlapping or
    irregular strides), in which case callers gather by index.
    """
    dims = [d for d in range(len(size)) if size[d] != 1 and stride[d] != 0]
    dims.sort(key=lambda d: -stride[d])
    if not dims:
        return ("scalar_like", offset)
    strides = [stride[d] for d in dims]
    sizes = [size[d] for d in dims]
    if any(s <= 0 for s in strides):
        return None
    box = [sizes[0]]
    for outer, inner, n in zip(strides, strides[1:], sizes[1:]):
        if outer % inner != 0 or outer // inner < n:
            return None  # strides that do not nest, or windows that overlap
        box.append(outer // inner)
    box.append(strides[-1])
    length = math.prod(box)
    return ("box", offset, length, tuple(box), tuple(sizes), tuple(dims))


def _read_impl(buffer, size, stride, offset):
    storage_numel = buffer.shape[0]
    numel = math.prod(size)
    if numel == 0:
        return jnp.zeros(size, buffer.dtype)
    if is_contiguous(size, stride):
        return jax.lax.slice(buffer, (offset,), (offset + numel,)).reshape(size)
    plan = _box_plan(tuple(size), tuple(stride), offset, storage_numel)
    if plan is None:
        return buffer[_index_array(size, stride, offset)]
    if plan[0] == "scalar_like":
        value = buffer[plan[1]]
        return jnp.broadcast_to(value, size)
    _, start, length, box, sizes, dims = plan
    end = min(start + length, storage_numel)
    flat = jax.lax.slice(buffer, (start,), (end,))
    if end - start < length:  # the box's last row runs past the buffer; padding is never read
        flat = jnp.pad(flat, (0, length - (end - start)))
    dense = flat.reshape(box)[tuple(slice(0, n) for n in sizes) + (0,)]
    # dense has the view's non-trivial dims in stride order; put them in the view's order.
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    dense = jnp.transpose(dense, order)
    kept = sorted(dims)
    shape_with_ones = [size[d] if d in kept else 1 for d in range(len(size))]
    return jnp.broadcast_to(dense.reshape(shape_with_ones), size)


def _index_array(size, stride, offset):
    index = jnp.full(size, offset, dtype=jnp.int32)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        index = index + (jnp.arange(n, dtype=jnp.int32) * s).reshape(shape)
    return index


def _write_impl(buffer, value, size, stride, offset):
    numel = math.prod(size)
    if numel == 0:
        return buffer
    value = jnp.broadcast_to(value.astype(buffer.dtype), size)
    if is_contiguous(size, stride):
        return jax.lax.dynamic_update_slice(buffer, value.reshape(-1), (offset,))
    index = _index_array(size, stride, offset)
    return buffer.at[index.reshape(-1)].set(value.reshape(-1))


def _is_whole(size, stride, offset, storage_numel) -> bool:
    """Does the view cover its whole storage, in order (a read is a reshape, a write a swap)?"""
    return offset == 0 and math.prod(size) == storage_numel and is_contiguous(size, stride)


def read_in_trace(buffer, size, stride, offset):
    """The view's value from its flat buffer, inside a jit trace (reshape/slice are free there)."""
    if _is_whole(size, stride, offset, buffer.shape[0]):
        return buffer.reshape(size)
    return _read_impl(buffer, size, stride, offset)


def write_in_trace(buffer, value, size, stride, offset):
    """The flat buffer after writing ``value`` through the view, inside a jit trace: how an
    in-place op's result lands in its destination within the op's own executable."""
    if _is_whole(size, stride, offset, buffer.shape[0]) and tuple(value.shape) == tuple(size):
        new = value.reshape(-1)
        return new if new.dtype == buffer.dtype else new.astype(buffer.dtype)
    return _write_impl(buffer, value, size, stride, offset)


@functools.lru_cache(maxsize=8192)
def _reader(size: tuple, stride: tuple, offset: int):
    return jax.jit(functools.partial(_read_impl, size=size, stride=stride, offset=offset),
                   compiler_options=runtime.op_program_options())


@functools.lru_cache(maxsize=8192)
def _writer(size: tuple, stride: tuple, offset: int):
    return jax.jit(functools.partial(_write_impl, size=size, stride=stride, offset=offset),
                   compiler_options=runtime.op_program_options())


def read(storage: Storage, size: tuple, stride: tuple, offset: int) -> jax.Array:
    """The value of the view ``(size, stride, offset)`` of ``storage`` as a dense array."""
    if _is_whole(size, stride, offset, storage.numel):
        return storage.shaped(tuple(size))
    return _reader(tuple(size), tuple(stride), int(offset))(storage.buffer)


def read_to_host(storage: Storage, size: tuple, stride: tuple, offset: int) -> np.ndarray:
    """The value of the view as a host array. A view of the whole storage is fetched as the
    buffer is and reshaped on the host: no device program (a reshape) runs for it, which on a
    TPU is a dispatch and a kernel launch for every scalar the host reads (a step's loss)."""
    if _is_whole(size, stride, offset, storage.numel):
        return np.asarray(jax.device_get(storage._resolved())).reshape(size)
    return np.asarray(jax.device_get(read(storage, size, stride, offset)))


def write(storage: Storage, size: tuple, stride: tuple, offset: int, value: jax.Array) -> None:
    """Write ``value`` (broadcast and cast as needed) through the view into ``storage``.

    A write of the whole storage replaces its buffer without reading the old one (in fused
    mode, a fresh tensor's recorded fill is then never run: a host-to-device copy into
    ``torch.empty`` does not flush the region)."""
    target = storage_dtype(storage.dtype)
    if _is_whole(size, stride, offset, storage.numel) and tuple(value.shape) == tuple(size):
        new = value.reshape(-1)
        if new.dtype != target:
            new = new.astype(target)
        storage.buffer = new
        return
    storage.buffer = _writer(tuple(size), tuple(stride), int(offset))(storage.buffer, value)


def write_host(storage: Storage, size: tuple, stride: tuple, offset: int, host: np.ndarray,
               shares_memory: bool) -> bool:
    """Replace the whole storage with a host array of exactly the view's shape, already in the
    storage dtype: one transfer, no device op, flat or in the view's shape as the platform
    keeps whole buffers (:func:`tpu_train.device.runtime.natural_buffers`). False (nothing
    written) when the view is not the whole storage in order: the caller then takes
    :func:`write`. ``shares_memory``: ``host`` is a CPU tensor's own memory (:func:`put_host`)."""
    if not _is_whole(size, stride, offset, storage.numel) or host.shape != tuple(size) \
            or host.dtype != storage_dtype(storage.dtype):
        return False
    storage.buffer = put_whole(host, runtime.jax_device(storage.device_index), shares_memory)
    return True


def put_whole(host: np.ndarray, device, shares_memory: bool) -> jax.Array:
    """A whole tensor's host array on ``device`` in the layout the platform keeps whole buffers
    in (:func:`tpu_train.device.runtime.natural_buffers`): its own shape, or flat. One transfer."""
    return put_host(host if runtime.natural_buffers(device.platform) else host.reshape(-1),
                    device, shares_memory)


_awaited_on_exit = threading.local()


def put_host(host: np.ndarray, device, shares_memory: bool) -> jax.Array:
    """``host`` on ``device``, one transfer, never aliasing a CPU tensor's memory.

    ``shares_memory``: ``host`` is a CPU tensor's own memory, which the user may write in place
    later. A transfer reads host memory after the call returns (until the device buffer is
    ready; the CPU client keeps the array as the buffer itself, whatever ``device_put``'s
    ``may_alias`` says), so such an array is copied first. Waiting for the transfer instead
    costs more for one tensor (a v5e host: 430-530 us from 4 KB to 256 KB against 100-240 us
    to copy and put; 3.3 ms at 16 MB against 1.7-2.6), but many transfers waited for together
    overlap: inside :func:`host_reads_awaited_on_exit` an accelerator's are not copied."""
    pending = getattr(_awaited_on_exit, "values", None)
    if shares_memory and (pending is None or device.platform == "cpu"):
        return jax.device_put(host.copy(), device)
    value = jax.device_put(host, device)
    if shares_memory:
        pending.append(value)
    return value


@contextlib.contextmanager
def host_reads_awaited_on_exit():
    """Within (on this thread): transfers from CPU tensors' own memory to an accelerator are not
    copied first but all waited for when the block ends, so they overlap. For a caller that
    hands no CPU tensor back to user code before it returns: ``module.to`` (a W1 model on a v5e
    host: 26 ms instead of 116 with every weight copied first; its transfers alone, 9.5)."""
    if getattr(_awaited_on_exit, "values", None) is not None:
        yield
        return
    _awaited_on_exit.values = []
    try:
        yield
    finally:
        values, _awaited_on_exit.values = _awaited_on_exit.values, None
        jax.block_until_ready(values)


def allocate(numel: int, dtype: torch.dtype, device_index: int, fill=0):
    """A fresh flat buffer on device ``device_index``; in fused mode, the pending buffer of a
    fill recorded in the device's region (XLA then fuses the fill into what reads it)."""
    device = runtime.jax_device(device_index)
    if type(fill) in (bool, float) or (type(fill) is int and -2**31 <= fill < 2**31):
        # One cached executable per (size, dtype, device), the fill value an input (an int
        # input is 32-bit: wider ones take the general path): eager jnp.full costs ~100 µs of
        # JAX's Python per factory call (torch.zeros, new_zeros in slice_backward, ...).
        dtype = storage_dtype(dtype)
        if lazy.active:
            aval = ((numel,), np.dtype(dtype))
            return lazy.region(device_index).record(_fill_body(numel, dtype), [fill], [aval])[0]
        key = (numel, dtype, device)
        if key not in _filled_before:
            _filled_before.add(key)
            if _host_fill_pays(numel * np.dtype(dtype).itemsize, device):
                return jax.device_put(np.full((numel,), fill, dtype), device)
        return _filler(numel, dtype, device)(scalars.on_device(fill, device_index))[0]
    return jnp.full((numel,), fill, dtype=storage_dtype(dtype), device=device)


class _FillOnRead:
    """An unfilled storage's pending buffer (:meth:`Storage.unfilled`), in the form of a
    finished copy (:meth:`Storage.fill_later`): its result is the fill, made when read."""

    __slots__ = ("numel", "dtype", "device_index")

    def __init__(self, numel: int, dtype: torch.dtype, device_index: int):
        self.numel, self.dtype, self.device_index = numel, dtype, device_index

    def result(self):
        return allocate(self.numel, self.dtype, self.device_index, 0)

    def done(self) -> bool:
        return True


# (numel, dtype, device) of every fill so far. The first fill of a size is a copy from the host
# where that is cheaper than compiling the fill's program: on a TPU a fill compiles for ~0.1 s
# (the first of a process ~0.8 s), and placing a model (``module.to("tpu")`` allocates every
# parameter before copying into it) or a one-off buffer would compile one per shape. A size
# filled again gets its program: from then on, a call costs no transfer.
_filled_before: set = set()
HOST_FILL_BYTES = 16 << 20  # past this, a transfer from the host costs more than a compile


def _host_fill_pays(nbytes: int, device) -> bool:
    """The CPU client compiles a fill in milliseconds and its arrays are host memory anyway."""
    return nbytes <= HOST_FILL_BYTES and runtime.natural_buffers(device.platform)


@functools.lru_cache(maxsize=4096)
def _fill_body(numel: int, dtype):
    """What a fused region replays for a fill (one function per size and dtype: the region's
    program is keyed by the functions it replays)."""
    return lambda value: [jnp.full((numel,), value, dtype=dtype)]


@functools.lru_cache(maxsize=4096)
def _filler(numel: int, dtype, device):
    return jax.jit(_fill_body(numel, dtype),
                   out_shardings=jax.sharding.SingleDeviceSharding(device),
                   compiler_options=runtime.op_program_options())
