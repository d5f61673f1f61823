"""In-place and ``out=`` ops: run the functional counterpart, then write through the views.

``x.add_(y)`` runs ``add.Tensor(x, y)`` and writes the result into ``x``'s storage at ``x``'s
geometry, so every view of that storage sees it. The functional counterpart of an op is found
from the schemas (``foo_.ov`` → ``foo.ov``; ``foo.out`` → the ``foo`` overload with the same
non-out arguments; ``foo`` mutating some inputs → ``foo_functional``), once per op.
"""

from __future__ import annotations

import functools

import torch

from tpu_train.device import storage as storage_mod
from tpu_train.device.tensor import TpuTensor, from_host, host_values, to_host

aten = torch.ops.aten


def _is_written(argument) -> bool:
    return argument.alias_info is not None and argument.alias_info.is_write


def _is_out_argument(argument) -> bool:
    return argument.kwarg_only and _is_written(argument)


def _signature(op, drop_out: bool):
    return tuple((a.name, str(a.type)) for a in op._schema.arguments
                 if not (drop_out and _is_out_argument(a)))


def _candidate_packets(op):
    name = op._schema.name.split("::")[1]
    names = []
    if name.endswith("_") and not name.endswith("__"):
        names.append(name[:-1])
    names += [name, f"{name}_functional", f"{name.rstrip('_')}_functional"]
    for candidate in names:
        packet = getattr(aten, candidate, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            yield packet


@functools.lru_cache(maxsize=None)
def functional_variant(op):
    """The non-mutating overload computing what ``op`` writes, or None."""
    from tpu_train.ops.registry import is_mutating

    wanted = _signature(op, drop_out=True)
    for packet in _candidate_packets(op):
        for overload_name in packet.overloads():
            candidate = getattr(packet, overload_name)
            if candidate is op or is_mutating(candidate):
                continue
            if _signature(candidate, drop_out=True) == wanted:
                return candidate
    return None


def bind_arguments(op, args, kwargs) -> dict:
    """Schema argument name → value, with defaults filled in."""
    bound = {}
    positional = list(args)
    for argument in op._schema.arguments:
        if not argument.kwarg_only and positional:
            bound[argument.name] = positional.pop(0)
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
        else:
            bound[argument.name] = None
    return bound


def functional_arguments(func, functional, bound: dict):
    """(positional, keyword) arguments of ``functional`` for a call of ``func`` bound as
    ``bound`` (what :func:`bind_arguments` returns)."""
    functional_kwargs = {a.name: bound[a.name] for a in functional._schema.arguments}
    positional = [functional_kwargs.pop(a.name) for a in functional._schema.arguments
                  if not a.kwarg_only]
    return positional, functional_kwargs


def split_results(func, functional, result):
    """``functional``'s result split into (fresh results of ``func``, values of what it writes),
    in the order of the schemas."""
    results = list(result) if isinstance(result, (tuple, list)) and _returns_many(functional) \
        else [result]
    fresh_count = sum(1 for r in func._schema.returns if r.alias_info is None)
    return results[:fresh_count], results[fresh_count:]


def written_pairs(func, functional, bound: dict, updates) -> list:
    """(destination, value) for every tensor ``func`` writes (list arguments element-wise)."""
    mutated = [bound[a.name] for a in func._schema.arguments if _is_written(a)]
    if len(updates) != len(mutated):
        raise NotImplementedError(
            f"cannot map the results of {functional} onto the arguments {func} mutates")
    pairs = []
    for destination, value in zip(mutated, updates):
        if isinstance(destination, (list, tuple)):
            pairs.extend(zip(destination, value))
        elif destination is not None:
            pairs.append((destination, value))
    return pairs


def run_mutating(func, args, kwargs):
    """The general (uncached) path; :mod:`tpu_train.device.op_cache` runs the common case as
    one executable and comes here for what it cannot key or plan."""
    from tpu_train.device import fallback, meta

    functional = functional_variant(func)
    if functional is None:
        return fallback.run_without_lowering(func, args, kwargs)
    # torch's meta kernel of the mutating op itself checks what the functional one cannot:
    # e.g. that an in-place result can be cast back to the destination's dtype.
    meta.meta_outputs(func, args, kwargs)
    bound = bind_arguments(func, args, kwargs)
    positional, functional_kwargs = functional_arguments(func, functional, bound)
    result = functional(*positional, **functional_kwargs)
    fresh, updates = split_results(func, functional, result)
    for destination, value in written_pairs(func, functional, bound, updates):
        assign(destination, value, func)
    return mutating_returns(func, bound, fresh)


def _returns_many(op) -> bool:
    returns = op._schema.returns
    return len(returns) > 1 or (len(returns) == 1 and str(returns[0].type).endswith("[]"))


def mutating_returns(func, bound, fresh):
    """What ``func`` returns: its fresh results, and the arguments it wrote for aliased returns."""
    fresh_values = iter(fresh)
    outputs = []
    written = [a for a in func._schema.arguments if _is_written(a)]
    for ret in func._schema.returns:
        if ret.alias_info is None:
            outputs.append(next(fresh_values))
            continue
        source = next((a for a in written if a.alias_info.before_set == ret.alias_info.before_set),
                      None)
        outputs.append(bound[source.name] if source is not None else None)
    if not func._schema.returns:
        return None
    if len(outputs) == 1:
        return outputs[0]
    return tuple(outputs)


def assign(destination, value, func=None) -> None:
    """Write ``value`` into ``destination`` through its geometry (cast, broadcast)."""
    if isinstance(destination, TpuTensor):
        if isinstance(value, TpuTensor):
            if value.device != destination.device:
                value = _move(value, destination.device.index)
            array = value.jax_value()
        else:
            host = value.detach().cpu()
            if host.dtype != destination.dtype:
                host = host.to(destination.dtype)  # torch's own conversion, on the host
            if storage_mod.write_host(
                    destination._storage, tuple(destination.shape), tuple(destination.stride()),
                    destination.storage_offset(), *host_values(host)):
                return  # a batch copied into a fresh tensor: one transfer
            array = from_host(host, destination.device.index).jax_value()
        if tuple(array.shape) != tuple(destination.shape):
            if _broadcastable(array.shape, destination.shape):
                import jax.numpy as jnp

                array = jnp.broadcast_to(array, tuple(destination.shape))
            else:
                raise RuntimeError(
                    f"{func or 'copy'}: cannot write a result of shape {tuple(array.shape)} into "
                    f"a tpu tensor of shape {tuple(destination.shape)} (out= tensors must already "
                    f"have the result's shape on the tpu device)")
        storage_mod.write(destination._storage, tuple(destination.shape),
                          tuple(destination.stride()), destination.storage_offset(), array)
    elif isinstance(destination, torch.Tensor):
        host = to_host(value) if isinstance(value, TpuTensor) else value
        with torch.utils._python_dispatch._disable_current_modes():
            destination.copy_(host)
    else:
        raise TypeError(f"cannot write into {type(destination).__name__}")


def _broadcastable(source, target) -> bool:
    if len(source) > len(target):
        return False
    for s, t in zip(reversed(source), reversed(target)):
        if s != t and s != 1:
            return False
    return True


def _move(tensor: TpuTensor, index: int) -> TpuTensor:
    import jax

    from tpu_train.device import runtime
    from tpu_train.device.tensor import wrap

    array = jax.device_put(tensor.jax_value(), runtime.jax_device(index))
    return wrap(array, tensor.dtype, index, tensor.shape)

