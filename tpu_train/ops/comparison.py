"""Comparisons, logical and bitwise ops, ``where`` and ``masked_fill``.

Comparisons promote both operands to their PyTorch common dtype before comparing (an int
tensor compared with ``2.5`` compares as float). Shifts follow PyTorch's rules for shift
amounts outside ``[0, bits)``, which C and XLA leave undefined.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tpu_train.ops.conversion import cast_scalar, convert, promote, result_dtype
from tpu_train.ops.registry import aten, lowers


def _compare(self, other, fn, scalar_other):
    if scalar_other:
        _, _, (a,), (b,) = promote(self, scalars=[other])
    else:
        _, _, (a, b), _ = promote(self, other)
    return fn(a, b)


def _register_comparison(name, fn):
    tensor_op = getattr(aten, name).Tensor
    scalar_op = getattr(aten, name).Scalar

    def compare_tensor(self, other):
        return _compare(self, other, fn, scalar_other=False)

    def compare_scalar(self, other):
        return _compare(self, other, fn, scalar_other=True)

    compare_tensor.__name__ = compare_tensor.__qualname__ = f"{name}_tensor"
    compare_scalar.__name__ = compare_scalar.__qualname__ = f"{name}_scalar"
    lowers(tensor_op)(compare_tensor)
    lowers(scalar_op)(compare_scalar)


for _name, _fn in {"eq": jnp.equal, "ne": jnp.not_equal, "lt": jnp.less, "le": jnp.less_equal,
                   "gt": jnp.greater, "ge": jnp.greater_equal}.items():
    _register_comparison(_name, _fn)


# ----------------------------------------------------------------------------- logical


def _truth(x):
    return jnp.asarray(x) != 0


@lowers(aten.logical_not.default)
def logical_not(self):
    return ~_truth(self)


@lowers(aten.logical_and.default)
def logical_and(self, other):
    return _truth(self) & _truth(other)


@lowers(aten.logical_or.default)
def logical_or(self, other):
    return _truth(self) | _truth(other)


@lowers(aten.logical_xor.default)
def logical_xor(self, other):
    return _truth(self) ^ _truth(other)


# ----------------------------------------------------------------------------- bitwise


def _bitwise(self, other, fn, scalar_other):
    if scalar_other:
        dtype, _, (a,), (b,) = promote(self, scalars=[other])
    else:
        dtype, _, (a, b), _ = promote(self, other)
    if jnp.issubdtype(dtype, jnp.floating):
        raise TypeError("bitwise ops are only defined on integer and bool tensors")
    return fn(a, b)


def _register_bitwise(name, fn):
    packet = getattr(aten, name)

    def bitwise_tensor(self, other):
        return _bitwise(self, other, fn, scalar_other=False)

    def bitwise_scalar(self, other):
        return _bitwise(self, other, fn, scalar_other=True)

    def bitwise_scalar_tensor(self, other):
        return _bitwise(other, self, lambda b, a: fn(a, b), scalar_other=True)

    for lowering, suffix in ((bitwise_tensor, "tensor"), (bitwise_scalar, "scalar"),
                             (bitwise_scalar_tensor, "scalar_tensor")):
        lowering.__name__ = lowering.__qualname__ = f"{name}_{suffix}"
    lowers(packet.Tensor)(bitwise_tensor)
    lowers(packet.Scalar)(bitwise_scalar)
    lowers(packet.Scalar_Tensor)(bitwise_scalar_tensor)


for _name, _fn in {"bitwise_and": jnp.bitwise_and, "bitwise_or": jnp.bitwise_or,
                   "bitwise_xor": jnp.bitwise_xor}.items():
    _register_bitwise(_name, _fn)


@lowers(aten.bitwise_not.default)
def bitwise_not(self):
    return ~self


def _bits(dtype) -> int:
    return jnp.iinfo(dtype).bits


def _shift_left(a, b):
    if a.dtype == jnp.bool_:
        a, b = a.astype(jnp.uint8), b.astype(jnp.uint8)
    shift = b.astype(a.dtype)
    in_range = (b >= 0) & (b < _bits(a.dtype))
    shifted = lax.shift_left(a, jnp.where(in_range, shift, 0))
    return jnp.where(in_range, shifted, jnp.zeros_like(a))


def _shift_right(a, b):
    if a.dtype == jnp.bool_:
        a, b = a.astype(jnp.uint8), b.astype(jnp.uint8)
    bits = _bits(a.dtype)
    in_range = (b >= 0) & (b < bits)
    # Out-of-range shifts fill with the sign bit, as PyTorch does (0 for unsigned).
    shift = jnp.where(in_range, b, bits - 1).astype(a.dtype)
    if jnp.issubdtype(a.dtype, jnp.signedinteger):
        return lax.shift_right_arithmetic(a, shift)
    return jnp.where(in_range, lax.shift_right_logical(a, shift), jnp.zeros_like(a))


def _register_shift(name, dunder, fn):
    packet = getattr(aten, name)

    def shift_tensor(self, other):
        return _bitwise(self, other, fn, scalar_other=False)

    def shift_tensor_scalar(self, other):
        return _bitwise(self, other, fn, scalar_other=True)

    def shift_scalar_tensor(self, other):
        return _bitwise(other, self, lambda b, a: fn(a, b), scalar_other=True)

    for lowering, suffix in ((shift_tensor, "tensor"), (shift_tensor_scalar, "tensor_scalar"),
                             (shift_scalar_tensor, "scalar_tensor")):
        lowering.__name__ = lowering.__qualname__ = f"{name}_{suffix}"
    lowers(packet.Tensor, getattr(aten, dunder).Tensor)(shift_tensor)
    lowers(packet.Tensor_Scalar, getattr(aten, dunder).Scalar)(shift_tensor_scalar)
    lowers(packet.Scalar_Tensor)(shift_scalar_tensor)


_register_shift("bitwise_left_shift", "__lshift__", _shift_left)
_register_shift("bitwise_right_shift", "__rshift__", _shift_right)


# ----------------------------------------------------------------------------- selection


@lowers(aten.where.self)
def where(condition, self, other):
    dtype, _, (a, b), _ = promote(self, other)
    return jnp.where(_truth(condition), a, b).astype(dtype)


@lowers(aten.where.ScalarSelf)
def where_scalar_self(condition, self, other):
    dtype, _, (b,), (a,) = promote(other, scalars=[self])
    return jnp.where(_truth(condition), a, b).astype(dtype)


@lowers(aten.where.ScalarOther)
def where_scalar_other(condition, self, other):
    dtype, _, (a,), (b,) = promote(self, scalars=[other])
    return jnp.where(_truth(condition), a, b).astype(dtype)


@lowers(aten.where.Scalar)
def where_scalar(condition, self, other):
    dtype = result_dtype(scalars=[self, other])
    return jnp.where(_truth(condition), cast_scalar(self, dtype), cast_scalar(other, dtype))


@lowers(aten.masked_fill.Scalar)
def masked_fill_scalar(self, mask, value):
    mask = jnp.broadcast_to(_truth(mask), self.shape)
    return jnp.where(mask, cast_scalar(value, self.dtype), self)


@lowers(aten.masked_fill.Tensor)
def masked_fill_tensor(self, mask, value):
    mask = jnp.broadcast_to(_truth(mask), self.shape)
    return jnp.where(mask, convert(value, self.dtype), self)
