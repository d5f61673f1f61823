"""The ``tpu`` tensor: a torch wrapper subclass over a :class:`Storage` and a strided geometry.

PyTorch sees an ordinary tensor of device ``tpu:i`` with real sizes, strides and storage
offset; its data live in a flat JAX buffer on PJRT device ``i``. All ATen ops on it go through
:mod:`tpu_train.device.dispatch`.
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpu_train.device import runtime, storage as storage_mod
from tpu_train.device.storage import Storage, contiguous_strides
from tpu_train.ops.dtypes import numpy_dtype, storage_dtype

DEVICE_TYPE = "tpu"
_DEVICES: dict = {}
_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass


def _device(index: int) -> torch.device:
    device = _DEVICES.get(index)
    if device is None:  # torch.device objects are immutable: one per index is enough
        device = _DEVICES[index] = torch.device(DEVICE_TYPE, index)
    return device


def new_tensor(storage: Storage, size: tuple, stride: tuple, offset: int = 0) -> "TpuTensor":
    """``TpuTensor(storage, size, stride, offset)`` for the op call path, where ``size`` and
    ``stride`` already are tuples (or ``torch.Size``) of ints: no conversions, no ``__init__``."""
    index = storage.device_index
    device = _DEVICES.get(index) or _device(index)  # inline look-up: one call less per op
    tensor = _make_wrapper_subclass(TpuTensor, size, strides=stride, storage_offset=offset,
                                    dtype=storage.dtype, device=device)
    tensor._storage = storage
    tensor.key_part = (size, stride, offset, storage.dtype, index)
    return tensor


def new_contiguous_tensor(storage: Storage, size: tuple, stride: tuple) -> "TpuTensor":
    """:func:`new_tensor` for a contiguous tensor at offset 0 whose ``stride`` is the contiguous
    one for ``size`` (an op's output): PyTorch computes the same strides itself, faster than it
    parses them."""
    index = storage.device_index
    device = _DEVICES.get(index) or _device(index)  # inline look-up: one call less per op
    tensor = _make_wrapper_subclass(TpuTensor, size, dtype=storage.dtype, device=device)
    tensor._storage = storage
    tensor.key_part = (size, stride, 0, storage.dtype, index)
    return tensor


def current_key_part(tensor: "TpuTensor") -> tuple:
    """``tensor.key_part`` as computed now from PyTorch's view of the tensor (slow: three
    calls into PyTorch)."""
    storage = tensor._storage
    return (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
            storage.dtype, storage.device_index)


_geometry_changes = 0


def geometry_changes() -> int:
    """How many times an existing tpu tensor changed its storage or geometry in place
    (:func:`refresh_key_part`) so far: what a caller that keeps tensors' storages and
    geometries (a compiled step's call plan) checks before comparing them one by one."""
    return _geometry_changes


def refresh_key_part(tensor: "TpuTensor") -> None:
    """Recompute ``tensor.key_part`` after its geometry or storage changed in place."""
    global _geometry_changes
    _geometry_changes += 1
    tensor.key_part = current_key_part(tensor)


def _outside_dynamo(function):
    """``function`` and everything it calls run eagerly even while torch.compile is active.

    torch.compile must never trace the eager execution path (it is JAX code): after a graph
    break the eager ops run here, outside dynamo. ``torch.compiler.disable`` does that with a
    Python wrapper that swaps dynamo's frame callback on every call, about a tenth of a small
    op's cost. Marking the function's code "skip, and skip what it calls" has the same effect,
    checked in C only while dynamo's callback is set: free otherwise."""
    try:
        # The C module, not torch._dynamo.types: importing torch._dynamo costs ~1 s at start-up.
        from torch._C._dynamo.eval_frame import (_FrameAction, _FrameExecStrategy,
                                                 set_code_exec_strategy)
    except ImportError:  # a torch without per-code strategies: the wrapper
        return torch.compiler.disable(function)
    set_code_exec_strategy(function.__code__,
                           _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    return function


def _dispatch(func, args, kwargs):
    """The first op call imports the dispatcher (it imports this module) and takes its place."""
    global _dispatch
    from tpu_train.device.dispatch import dispatch

    _dispatch = dispatch
    return dispatch(func, args, kwargs)


class TpuTensor(torch.Tensor):
    """A tensor on a ``tpu`` device; see the module docstring.

    ``key_part`` is what the op cache keys this tensor by, ``(size, stride, storage_offset,
    dtype, device_index)``, kept with the tensor: reading sizes and strides back from PyTorch
    costs about a microsecond each per op. Every in-place change of geometry or storage
    (:func:`refresh_key_part`) renews it."""

    _storage: Storage
    key_part: tuple
    __slots__ = ("_storage", "key_part")

    @staticmethod
    def __new__(cls, storage: Storage, size, stride, offset: int = 0, requires_grad: bool = False):
        tensor = _make_wrapper_subclass(
            cls, tuple(size), strides=tuple(stride), storage_offset=int(offset),
            dtype=storage.dtype, device=_device(storage.device_index),
            requires_grad=requires_grad)
        tensor._storage = storage
        tensor.key_part = current_key_part(tensor)  # a new tensor: no change to count
        return tensor

    def __init__(self, *args, **kwargs):
        pass

    # Python-level torch functions go straight to dispatch: nothing to intercept there.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    @_outside_dynamo
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        for t in types:
            if t is not TpuTensor and not issubclass(t, TpuTensor):
                # Another subclass (e.g. torch's AsyncCollectiveTensor) wraps a tpu tensor: let
                # it handle the op first; it unwraps to us.
                return NotImplemented
        kwargs = kwargs or {}
        try:
            return _dispatch(func, args, kwargs)
        except Exception as error:
            if torch._C._current_graph_task_id() == -1:
                raise
            return _defer_backward_error(func, args, kwargs, error)

    # ``param.data = other`` swaps the TensorImpl's metadata in C++; the storage this class
    # keeps in Python must follow it.
    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, new):
        torch.Tensor.data.__set__(self, new)
        if isinstance(new, TpuTensor):
            self._storage = new._storage
            refresh_key_part(self)

    # -- value access -------------------------------------------------------------------------

    def jax_value(self) -> jax.Array:
        """This tensor's elements as a dense ``jax.Array`` (in the storage dtype)."""
        return storage_mod.read(self._storage, tuple(self.shape), tuple(self.stride()),
                                self.storage_offset())

    def __repr__(self, *, tensor_contents=None):
        body = repr(to_host(self))
        suffix = f", device='{self.device}'"
        if self.requires_grad:
            suffix += ", requires_grad=True"
        elif self.grad_fn is not None:
            suffix += f", grad_fn=<{type(self.grad_fn).__name__}>"
        return body[:-1] + suffix + ")" if body.endswith(")") else body + suffix

    def tolist(self):
        # torch refuses tolist() on tensor subclasses; a device tensor converts like CUDA's:
        # through host memory.
        return to_host(self).tolist()

    def numpy(self, *, force: bool = False):
        if force:
            return to_host(self.detach()).numpy()
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use "
                        f"Tensor.cpu() to copy the tensor to host memory first.")

    def __reduce_ex__(self, protocol):
        # Torch's own rebuild path for storage-less device tensors: honours map_location and
        # is allowed under torch.load(weights_only=True).
        if getattr(self, "_is_param", False):
            # A Parameter of a subclass is the subclass marked ``_is_param``: rebuild it as a
            # Parameter (torch.save(model) / torch.load keep model.parameters() Parameters).
            # The pickle memo keeps a shared Parameter shared.
            return (torch._utils._rebuild_parameter,
                    (self.detach(), self.requires_grad, collections.OrderedDict()))
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (to_host(self), self.dtype, str(self.device), self.requires_grad))


_deferred_graph_tasks: set = set()


def _defer_backward_error(func, args, kwargs, error):
    """Report an op's error at the end of the backward pass instead of inside it.

    An exception raised from ``__torch_dispatch__`` inside the autograd engine unwinds through
    the engine's stream guard, whose destructor calls back into Python while the error is still
    pending: the process aborts ("terminate called without an active exception"). So inside a
    backward pass the error is queued as an engine callback, which raises it cleanly once the
    pass ends, and the failing op returns zeros of the right shape meanwhile (they are never
    seen: backward() raises).
    """
    from tpu_train.device.meta import meta_outputs

    task = torch._C._current_graph_task_id()
    if task not in _deferred_graph_tasks:
        _deferred_graph_tasks.add(task)

        def raise_deferred():
            _deferred_graph_tasks.discard(task)
            raise error

        torch.autograd.Variable._execution_engine.queue_callback(raise_deferred)
    meta = meta_outputs(func, args, kwargs)
    if meta is None:  # no meta kernel (many backward ops): the CPU kernel on zeros tells
        meta = _result_on_cpu_zeros(func, args, kwargs)
    if meta is None:
        raise error

    def placeholder(value):
        if isinstance(value, torch.Tensor):
            index = next(a.device.index for a in torch.utils._pytree.tree_flatten((args, kwargs))[0]
                         if isinstance(a, TpuTensor))
            return wrap(jnp.zeros(tuple(value.shape), storage_dtype(value.dtype)), value.dtype,
                        index)
        return value

    return torch.utils._pytree.tree_map(placeholder, meta)


def _result_on_cpu_zeros(func, args, kwargs):
    """``func``'s result with every tpu tensor argument replaced by CPU zeros of its shape and
    dtype (only shapes and dtypes are read), or None when the CPU kernel refuses them too."""
    def stand_in(value):
        if isinstance(value, TpuTensor):
            return torch.zeros(tuple(value.shape), dtype=value.dtype)
        return value

    try:
        return func(*torch.utils._pytree.tree_map(stand_in, args),
                    **torch.utils._pytree.tree_map(stand_in, kwargs))
    except Exception:  # noqa: BLE001 - no stand-in: the caller reports the original error
        return None


# -- storage access for the layers above (compile, distributed, parallel) -------------------
# A tpu tensor's storage is one flat buffer shared by all its views; layers that place,
# donate or checkpoint buffers go through these instead of the tensor's private attribute.


def storage_of(tensor: torch.Tensor) -> Storage:
    """The storage behind a tpu tensor (``storage_of(t).buffer`` is its flat ``jax.Array``,
    which may be read or replaced; every view of the storage sees a replacement)."""
    if not isinstance(tensor, TpuTensor):
        where = getattr(tensor, "device", None)
        raise TypeError(f"expected a tensor on the tpu device, got a {type(tensor).__name__} on "
                        f"{where}: move it (for a model: before creating its optimizer) to the "
                        "tpu device first")
    return tensor._storage


def owns_whole_storage(tensor: torch.Tensor) -> bool:
    """True when the tpu tensor is exactly its storage's buffer, in order: its new value can
    replace the buffer, and a split of the buffer is a split of the tensor."""
    storage = storage_of(tensor)
    size, stride, offset = tensor.key_part[:3]
    return (offset == 0 and math.prod(size) == storage.numel
            and storage_mod.is_contiguous(size, stride))


def write_elements(tensor: torch.Tensor, value: jax.Array) -> None:
    """Write ``value`` (the tensor's shape) into the storage elements the tpu tensor covers,
    in place: the tensor and every view sharing those elements see it."""
    storage_mod.write(storage_of(tensor), tuple(tensor.shape), tuple(tensor.stride()),
                      tensor.storage_offset(), value)


def wrap(value: jax.Array, dtype: torch.dtype, device_index: int, shape=None) -> TpuTensor:
    """A fresh contiguous tensor holding ``value`` (cast to the storage dtype of ``dtype``)."""
    shape = tuple(value.shape) if shape is None else tuple(shape)
    target = storage_dtype(dtype)
    if value.dtype != target:
        value = value.astype(target)
    buffer = value if value.ndim == 1 else value.reshape(-1)
    return TpuTensor(Storage(buffer, dtype, device_index), shape, contiguous_strides(shape), 0)


def host_values(tensor: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A CPU tensor's values as a numpy array in the device storage dtype, and whether that
    array shares the tensor's memory (no copy or conversion was needed to make it): for
    :func:`tpu_train.device.storage.put_host`, which transfers it safely either way. Anything
    that keeps the array takes :func:`host_array`."""
    tensor = tensor.detach()
    contiguous = tensor.contiguous()
    shared = contiguous.data_ptr() == tensor.data_ptr()
    if tensor.dtype == torch.bfloat16:
        return contiguous.view(torch.int16).numpy().view(jnp.bfloat16), shared
    array = contiguous.numpy()
    target = storage_dtype(tensor.dtype)
    if array.dtype != target:
        return array.astype(target), False
    return array, shared


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a numpy array in the device storage dtype, never sharing the
    tensor's memory: the CPU client may alias host memory zero-copy, and a later in-place write
    to the CPU tensor must not change what was made from it."""
    array, shared = host_values(tensor)
    return array.copy() if shared else array


def put_cpu_tensor(tensor: torch.Tensor, device, flat: bool = True) -> jax.Array:
    """A CPU tensor's values on JAX device ``device``, one transfer: one flat buffer (the
    storage's), or in the tensor's shape when not ``flat``."""
    # Flattened on the host: a device-side reshape would be one more eager JAX op.
    array, shared = host_values(tensor)
    return storage_mod.put_host(array.reshape(-1) if flat else array, device, shared)


def from_host(tensor: torch.Tensor, device_index: int) -> TpuTensor:
    """Copy a CPU tensor onto ``tpu:device_index``."""
    array = put_cpu_tensor(tensor, runtime.jax_device(device_index))
    shape = tuple(tensor.shape)
    return TpuTensor(Storage(array, tensor.dtype, device_index), shape, contiguous_strides(shape))


def from_host_whole(tensor: torch.Tensor, device_index: int) -> TpuTensor:
    """Copy a CPU tensor onto ``tpu:device_index`` as one buffer in the layout the platform
    keeps whole tensors in (its own shape on a TPU, flat on the CPU client:
    :func:`tpu_train.device.runtime.natural_buffers`): one transfer and no device program, as
    ``.to("tpu")`` ends up, without its detour through torch's ``empty`` and a dispatched
    ``copy_`` (host time a training loop spends per batch). What a compiled step reads whole."""
    shape = tuple(tensor.shape)
    host, shared = host_values(tensor)
    array = storage_mod.put_whole(host, runtime.jax_device(device_index), shared)
    return TpuTensor(Storage.whole(array, tensor.dtype, device_index), shape,
                     contiguous_strides(shape))


def to_host(tensor: TpuTensor) -> torch.Tensor:
    """A CPU copy of a tpu tensor, in its torch dtype (int64 and float64 restored)."""
    array = storage_mod.read_to_host(tensor._storage, tuple(tensor.shape), tuple(tensor.stride()),
                                     tensor.storage_offset())
    if tensor.dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(array, dtype=numpy_dtype(tensor.dtype), copy=True))
