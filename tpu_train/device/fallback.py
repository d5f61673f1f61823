"""Ops without a lowering: torch's decompositions, then (opt-in) the CPU, else a clear error."""

from __future__ import annotations

import functools
import os
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tpu_train.device.tensor import TpuTensor, from_host, to_host

CPU_FALLBACK_ENV = "TPU_TRAIN_CPU_FALLBACK"
_warned: set = set()


@functools.lru_cache(maxsize=None)
def _decompositions() -> dict:
    from torch._decomp import core_aten_decompositions, decomposition_table

    # Decompositions written with torch._refs produce prims ops, which have no lowering:
    # keep only those written in aten ops.
    table = {op: fn for op, fn in decomposition_table.items()
             if not getattr(fn, "__module__", "").startswith("torch._refs")}
    table.update(core_aten_decompositions())
    return table


def _cpu_fallback_enabled() -> bool:
    return os.environ.get(CPU_FALLBACK_ENV, "") not in ("", "0")


def run_without_lowering(func, args, kwargs):
    decomposition = _decompositions().get(func)
    if decomposition is not None:
        return decomposition(*args, **kwargs)
    result = func.decompose(*args, **kwargs)
    if result is not NotImplemented:
        return result
    if _cpu_fallback_enabled():
        return run_on_cpu(func, args, kwargs)
    raise NotImplementedError(
        f"The operator '{func}' is not implemented for the tpu device (no lowering in "
        f"tpu_train.ops and no torch decomposition). Set {CPU_FALLBACK_ENV}=1 to run it on the "
        f"CPU instead (slow: the data goes to the host and back).")


def run_on_cpu(func, args, kwargs):
    """Run ``func`` on CPU copies of the tpu arguments; copy mutated arguments back."""
    if func not in _warned:
        _warned.add(func)
        warnings.warn(f"{func} is not lowered for the tpu device: running it on the CPU "
                      f"({CPU_FALLBACK_ENV}=1)", stacklevel=3)
    device_index = next(leaf.device.index for leaf in tree_flatten((args, kwargs))[0]
                        if isinstance(leaf, TpuTensor))
    originals: list = []

    def to_cpu(value):
        if isinstance(value, TpuTensor):
            host = to_host(value)
            originals.append((value, host))
            return host
        return value

    cpu_args, cpu_kwargs = tree_map(to_cpu, (args, kwargs))
    result = func(*cpu_args, **cpu_kwargs)
    from tpu_train.device.mutation import assign, bind_arguments

    bound = bind_arguments(func, args, kwargs)
    written = {id(leaf) for a in func._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write
               for leaf in tree_flatten(bound[a.name])[0]}
    for device_tensor, host in originals:
        if id(device_tensor) in written:
            assign(device_tensor, host, func)
    host_to_device = {id(host): device_tensor for device_tensor, host in originals}

    def to_device(value):
        if isinstance(value, torch.Tensor):
            if id(value) in host_to_device:
                return host_to_device[id(value)]
            return from_host(value, device_index)
        return value

    return tree_map(to_device, result)
