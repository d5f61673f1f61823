"""``_foreach_*`` ops as per-tensor lowerings, and the fused Adam/AdamW/SGD optimizer steps.

Every functional ``_foreach_<name>.<overload>`` is registered generically: at call time it binds
its arguments by schema, picks the per-tensor overload of ``<name>`` whose schema accepts one
element of each list (``_foreach_add.List`` → ``add.Tensor``, ``.ScalarList`` → ``add.Scalar``
with that element's scalar), and runs that op's lowering on each tensor. Resolving lazily means
the per-tensor lowering may live in any family module, registered in any order.

The fused optimizers follow PyTorch's CPU kernels (grad unscaling written back to ``grads``,
``found_inf`` skipping the whole step, unscaling included) with hyperparameters that may be traced scalars.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import torch

from tpu_train.ops import scalar_power
from tpu_train.ops.conversion import opmath_dtype
from tpu_train.ops.registry import aten, get_lowering, is_mutating, lowers

# Per-tensor ops to try, in order, where the same-named packet is not (only) the answer.
_TARGETS = {
    "maximum": ["maximum", "clamp_min"],  # _foreach_maximum.Scalar is clamp_min(x, scalar)
    "minimum": ["minimum", "clamp_max"],
    "norm": ["linalg_vector_norm"],
}


def _kind(jit_type) -> str:
    """``Tensor``, ``Scalar``, ``Tensor[]``, ``Scalar[]`` or ``other`` for a schema type."""
    if jit_type.kind() == "OptionalType":
        jit_type = jit_type.getElementType()
    kind = jit_type.kind()
    if kind == "TensorType":
        return "Tensor"
    if kind in ("NumberType", "FloatType", "IntType"):
        return "Scalar"
    if kind == "ListType":
        element = _kind(jit_type.getElementType())
        return element + "[]" if element in ("Tensor", "Scalar") else "other"
    return "other"


def _element_kind(argument) -> str:
    """The kind one per-tensor call sees for a foreach argument."""
    kind = _kind(argument.type)
    if kind.endswith("[]"):
        return kind[:-2]
    if argument.name == "scalars" and kind == "Tensor":
        return "Scalar"  # a 1-D tensor holding one scalar per list element
    return kind


def _binding(foreach_args, target_schema):
    """Map foreach argument names to target argument names, or None when they do not fit.

    Same-named arguments pair up; the others take the next unpaired target argument in order.
    """
    target_args = list(target_schema.arguments)
    unbound = [a.name for a in target_args]
    by_name = {a.name: a for a in target_args}
    mapping = {}
    for argument in foreach_args:
        name = argument.name if argument.name in unbound else (unbound[0] if unbound else None)
        if name is None:
            return None
        element, target_kind = _element_kind(argument), _kind(by_name[name].type)
        if element in ("Tensor", "Scalar") and element != target_kind:
            return None
        mapping[argument.name] = name
        unbound.remove(name)
    if any(not by_name[n].has_default_value() and by_name[n].type.kind() != "OptionalType"
           for n in unbound):
        return None
    return mapping


@functools.lru_cache(maxsize=None)
def _resolve(foreach_op: torch._ops.OpOverload):
    """The per-tensor overload and argument mapping for one foreach overload."""
    name = foreach_op._schema.name.split("::")[1][len("_foreach_"):]
    for target_name in _TARGETS.get(name, [name]):
        packet = getattr(aten, target_name, None)
        if packet is None:
            continue
        for overload_name in packet.overloads():
            target = getattr(packet, overload_name)
            if is_mutating(target):
                continue
            mapping = _binding(foreach_op._schema.arguments, target._schema)
            if mapping is not None:
                return target, mapping
    raise NotImplementedError(f"no per-tensor op matches {foreach_op}")


def _bind_arguments(schema, args, kwargs):
    values = {}
    for argument, value in zip(schema.arguments, args):
        values[argument.name] = value
    values.update(kwargs)
    for argument in schema.arguments:
        if argument.name not in values and argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


def _make_foreach_lowering(foreach_op):
    def lowering(*args, **kwargs):
        target, mapping = _resolve(foreach_op)
        per_tensor = get_lowering(target)
        if per_tensor is None:
            raise NotImplementedError(f"{foreach_op} needs a lowering of {target}")
        values = _bind_arguments(foreach_op._schema, args, kwargs)
        lists = {a.name for a in foreach_op._schema.arguments
                 if _kind(a.type).endswith("[]") or _element_kind(a) != _kind(a.type)}
        length = len(next(values[n] for n in lists if n != "scalars"))
        results = []
        for i in range(length):
            call = {mapping[n]: (v[i] if n in lists else v) for n, v in values.items()}
            results.append(per_tensor.fn(**call))
        return results

    lowering.__name__ = lowering.__qualname__ = str(foreach_op).replace(".", "_")
    return lowering


def foreach_overloads() -> list[torch._ops.OpOverload]:
    """Every functional ``_foreach_*`` overload this torch build has."""
    names = sorted({schema.name.split("::")[1] for schema in torch._C._jit_get_all_schemas()
                    if schema.name.startswith("aten::_foreach_")})
    overloads = []
    for name in names:
        if name.endswith("_"):
            continue
        packet = getattr(aten, name)
        for overload_name in packet.overloads():
            op = getattr(packet, overload_name)
            if not is_mutating(op):
                overloads.append(op)
    return overloads


# _foreach_mm has no per-tensor counterpart of that name in every version; powsum is a fused
# sum(|x|^p): both are left to their decompositions.
_NOT_PER_TENSOR = {"_foreach_mm", "_foreach_powsum"}

# Foreach ops whose per-tensor lowering reads its float scalar as a Python value
# (registered with static_floats): pow.Scalar's base.
_STATIC_FLOATS = {aten._foreach_pow.ScalarAndTensor}

for _op in foreach_overloads():
    if _op._schema.name.split("::")[1] not in _NOT_PER_TENSOR:
        lowers(_op, static_floats=_op in _STATIC_FLOATS)(_make_foreach_lowering(_op))


# ----------------------------------------------------------------------------- fused optimizers


def _unscale(grads, grad_scale):
    if grad_scale is None:
        return list(grads)
    scale = grad_scale.astype(jnp.float32)
    return [(g.astype(opmath_dtype(g.dtype)) / scale).astype(g.dtype) for g in grads]


def _skip_if_found_inf(found_inf, updated, original):
    """Keep every original value when ``found_inf`` is set (an overflowed AMP step)."""
    if found_inf is None:
        return updated
    skip = jnp.reshape(found_inf, ()) != 0
    return [[jnp.where(skip, o, u) for u, o in zip(new, old)] for new, old in zip(updated, original)]


def _one_minus_power(beta, steps):
    """Adam's bias correction 1 - beta**step for whole-number float32 ``steps`` (a vector), as
    PyTorch's CPU kernel gets it in double precision, to about one float32 rounding.

    ``1 - jnp.power(beta, step)`` in float32 cancels: 1 - 0.999**1 = 0.001 keeps only the last
    three digits of the power, so each unit of the power's error becomes a thousand of the
    result's, and on a TPU, whose float32 pow is some 80 units off, that is a 1e-3 relative
    error in the first steps' updates. A Python-number beta's power is a float-float pair
    (hi + lo, :mod:`scalar_power`), and 1 - hi is exact while hi >= 1/2 (Sterbenz), so the
    one rounding is the final subtraction's (two below 1/2, where the result is over 1/2)."""
    if scalar_power.is_host_base(beta):
        hi, lo, shift = scalar_power.power_parts(beta, steps)
        return (1 - scalar_power.scale(hi, shift)) - scalar_power.scale(lo, shift)
    return _one_minus_traced_power(jnp.asarray(beta, jnp.float32), steps)


def _one_minus_traced_power(beta, steps):
    """1 - beta**step for a traced (or zero) float32 beta, with no transcendental function:
    beta**m built by multiplication over the bits of the step, and while it is over 1/2 (where
    1 - beta**m would cancel) 1 - beta**t taken as (1 - beta) * (1 + beta + ... + beta**(t-1)):
    1 - beta is exact and the geometric sum, built alongside by doubling, has positive terms."""
    count = steps.astype(jnp.int32)
    total = jnp.zeros_like(steps)  # 1 + beta + ... + beta**(m-1) for m the bits of t read so far
    power = jnp.ones_like(steps)  # beta**m
    for bit in range(scalar_power.EXPONENT_BITS - 1, -1, -1):
        total, power = total * (1 + power), power * power  # m -> 2m
        take = ((count >> bit) & 1) == 1  # m -> m + 1
        total = jnp.where(take, 1 + beta * total, total)
        power = jnp.where(take, power * beta, power)
    return jnp.where(power > 0.5, (1 - beta) * total, 1 - power)


def _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1,
          beta2, weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled):
    grads_out = _unscale(grads, grad_scale)
    steps = jnp.stack([jnp.reshape(s, ()) for s in state_steps]).astype(jnp.float32)
    corrections1, corrections2 = _one_minus_power(beta1, steps), _one_minus_power(beta2, steps)
    new_params, new_avgs, new_sqs, new_maxes = [], [], [], []
    for i, (param, grad) in enumerate(zip(params, grads_out)):
        compute = opmath_dtype(param.dtype)
        p = param.astype(compute)
        g = grad.astype(compute)
        g = -g if maximize else g
        lr_c = jnp.asarray(lr, compute)
        if decoupled:
            p = p - lr_c * weight_decay * p
        else:
            g = g + p * weight_decay
        exp_avg = exp_avgs[i].astype(compute)
        exp_avg = exp_avg + (1 - beta1) * (g - exp_avg)
        exp_avg_sq = exp_avg_sqs[i].astype(compute) * beta2 + (1 - beta2) * g * g
        bias_correction1 = corrections1[i]
        bias_correction2_sqrt = jnp.sqrt(corrections2[i])
        if amsgrad:
            max_sq = jnp.maximum(max_exp_avg_sqs[i].astype(compute), exp_avg_sq)
            new_maxes.append(max_sq.astype(max_exp_avg_sqs[i].dtype))
            denom = jnp.sqrt(max_sq) / bias_correction2_sqrt + eps
        else:
            denom = jnp.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        p = p - (lr_c / bias_correction1) * exp_avg / denom
        new_params.append(p.astype(param.dtype))
        new_avgs.append(exp_avg.astype(exp_avgs[i].dtype))
        new_sqs.append(exp_avg_sq.astype(exp_avg_sqs[i].dtype))
    if not amsgrad:
        new_maxes = list(max_exp_avg_sqs)
    updated = [new_params, grads_out, new_avgs, new_sqs, new_maxes]
    original = [list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                list(max_exp_avg_sqs)]
    # A skipped step leaves everything untouched, the grads' unscaling included.
    return tuple(_skip_if_found_inf(found_inf, updated, original))


@lowers(aten._fused_adam.default, aten._fused_adam.tensor_lr)
def fused_adam(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1,
               beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    return _adam(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr=lr,
                 beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
                 maximize=maximize, grad_scale=grad_scale, found_inf=found_inf, decoupled=False)


@lowers(aten._fused_adamw.default, aten._fused_adamw.tensor_lr)
def fused_adamw(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1,
                beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    return _adam(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr=lr,
                 beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
                 maximize=maximize, grad_scale=grad_scale, found_inf=found_inf, decoupled=True)


@lowers(aten._fused_sgd.default, aten._fused_sgd.tensor_lr)
def fused_sgd(self, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening,
              nesterov, maximize, is_first_step, grad_scale=None, found_inf=None):
    grads_out = _unscale(grads, grad_scale)
    use_buffers = len(momentum_buffer_list) > 0
    new_params, new_buffers = [], []
    for i, (param, grad) in enumerate(zip(self, grads_out)):
        compute = opmath_dtype(param.dtype)
        p, g = param.astype(compute), grad.astype(compute)
        g = -g if maximize else g
        g = g + weight_decay * p
        if use_buffers:
            old = momentum_buffer_list[i].astype(compute)
            buffer = g if is_first_step else momentum * old + (1 - dampening) * g
            # momentum may be traced: where() keeps PyTorch's "momentum == 0: no buffer".
            has_momentum = jnp.asarray(momentum) != 0
            new_buffers.append(jnp.where(has_momentum, buffer, old)
                               .astype(momentum_buffer_list[i].dtype))
            step_direction = g + momentum * buffer if nesterov else buffer
            g = jnp.where(has_momentum, step_direction, g)
        p = p - jnp.asarray(lr, compute) * g
        new_params.append(p.astype(param.dtype))
    if not use_buffers:
        new_buffers = list(momentum_buffer_list)
    return tuple(_skip_if_found_inf(found_inf, [new_params, grads_out, new_buffers],
                                    [list(self), list(grads), list(momentum_buffer_list)]))
