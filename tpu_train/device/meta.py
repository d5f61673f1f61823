"""What torch itself says about an op call: the device it runs on, and its meta result.

PyTorch's meta kernels decide output shapes and dtypes and raise PyTorch's own errors; the
eager op cache (:mod:`tpu_train.device.op_cache`) asks them once per call signature, the slow
paths (views of a new geometry, in-place ops, errors raised inside backward) on every call.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tpu_train.device.tensor import TpuTensor


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


_META_CACHE: dict = {}


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
                                             or "tensor.item()" in str(error).lower()):
            result = None
        else:
            raise
    if key is not None:
        if len(_META_CACHE) > 50_000:
            _META_CACHE.clear()
        _META_CACHE[key] = result
    return result
