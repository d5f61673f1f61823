"""Element-wise arithmetic and math: unary functions and binary arithmetic.

Every op follows PyTorch's type promotion (:func:`conversion.promote`) and computes in
PyTorch's opmath type (bf16/f16 in float32), returning the result dtype. Integer division,
remainder and power keep PyTorch's rounding and sign rules, which differ from C's and NumPy's
in places. Comparisons, logical/bitwise ops and ``where`` live in :mod:`comparison`;
activations in :mod:`activations`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.scipy import special

from tpu_train.ops import scalar_power
from tpu_train.ops.float_remainder import fmod
from tpu_train.ops.conversion import (cast_scalar, float_result_dtype, is_floating, is_integral,
                                      opmath_dtype, promote, result_dtype)
from tpu_train.ops.registry import aten, lowers

# ----------------------------------------------------------------------------- unary


def _register_float_unary(op, compute, name):
    """Register a unary op that maps integers to float32 and computes in opmath precision."""

    def lowering(self):
        dtype = float_result_dtype(self.dtype)
        return compute(self.astype(opmath_dtype(dtype))).astype(dtype)

    lowering.__name__ = lowering.__qualname__ = name
    lowers(op)(lowering)


def _digamma(x):
    # PyTorch: digamma(±0) = ∓inf (the pole's one-sided limit), where XLA gives NaN.
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), lax.digamma(x))


def _sigmoid(x):
    return 1 / (1 + jnp.exp(-x))


_FLOAT_UNARY = {
    aten.exp.default: jnp.exp,
    aten.exp2.default: jnp.exp2,
    aten.expm1.default: jnp.expm1,
    aten.log.default: jnp.log,
    aten.log2.default: jnp.log2,
    aten.log10.default: jnp.log10,
    aten.log1p.default: jnp.log1p,
    aten.sqrt.default: jnp.sqrt,
    aten.rsqrt.default: lax.rsqrt,
    aten.reciprocal.default: lambda x: 1 / x,
    aten.sin.default: jnp.sin,
    aten.cos.default: jnp.cos,
    aten.tan.default: jnp.tan,
    aten.asin.default: jnp.arcsin,
    aten.acos.default: jnp.arccos,
    aten.atan.default: jnp.arctan,
    aten.sinh.default: jnp.sinh,
    aten.cosh.default: jnp.cosh,
    aten.tanh.default: jnp.tanh,
    aten.asinh.default: jnp.arcsinh,
    aten.acosh.default: jnp.arccosh,
    aten.atanh.default: jnp.arctanh,
    aten.erf.default: special.erf,
    aten.erfc.default: special.erfc,
    aten.erfinv.default: special.erfinv,
    aten.sigmoid.default: _sigmoid,
    aten.lgamma.default: lax.lgamma,
    aten.digamma.default: _digamma,
    aten.i0.default: special.i0,
    aten.sinc.default: jnp.sinc,
    aten.deg2rad.default: jnp.deg2rad,
    aten.rad2deg.default: jnp.rad2deg,
}

for _op, _fn in _FLOAT_UNARY.items():
    _register_float_unary(_op, _fn, _op._schema.name.split("::")[1])


def _same_dtype(self, compute):
    return compute(self.astype(opmath_dtype(self.dtype))).astype(self.dtype)


@lowers(aten.abs.default)
def abs_(self):
    return self if self.dtype == jnp.bool_ else jnp.abs(self)


@lowers(aten.neg.default)
def neg(self):
    return jnp.negative(self)


@lowers(aten.sign.default, aten.sgn.default)
def sign(self):
    if self.dtype == jnp.bool_:
        return self
    if is_floating(self.dtype):
        # PyTorch gives sign(nan) = 0; jnp.sign would keep the NaN.
        return jnp.where(jnp.isnan(self), jnp.zeros((), self.dtype), jnp.sign(self))
    return jnp.sign(self)


@lowers(aten.signbit.default)
def signbit(self):
    return jnp.signbit(self) if is_floating(self.dtype) else self < 0


def _integral_identity(compute):
    def lowering(self):
        return self if is_integral(self.dtype, include_bool=True) else compute(self)
    return lowering


floor = lowers(aten.floor.default)(_integral_identity(jnp.floor))
ceil = lowers(aten.ceil.default)(_integral_identity(jnp.ceil))
trunc = lowers(aten.trunc.default, aten.fix.default)(_integral_identity(jnp.trunc))
# jnp.round rounds half to even, as PyTorch's nearbyint does.
round_ = lowers(aten.round.default)(_integral_identity(jnp.round))


@lowers(aten.round.decimals)
def round_decimals(self, *, decimals=0):
    if is_integral(self.dtype, include_bool=True):
        return self

    def compute(x):
        if decimals >= 0:
            scale = jnp.asarray(10.0 ** decimals, x.dtype)
            return jnp.round(x * scale) / scale
        scale = jnp.asarray(10.0 ** -decimals, x.dtype)
        return jnp.round(x / scale) * scale

    return _same_dtype(self, compute)


@lowers(aten.frac.default)
def frac(self):
    return _same_dtype(self, lambda x: x - jnp.trunc(x))


@lowers(aten.logit.default)
def logit(self, eps=None):
    dtype = float_result_dtype(self.dtype)
    x = self.astype(opmath_dtype(dtype))
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x)).astype(dtype)


@lowers(aten.isnan.default)
def isnan(self):
    return jnp.isnan(self) if not is_integral(self.dtype, True) else jnp.zeros(self.shape, bool)


@lowers(aten.isinf.default)
def isinf(self):
    return jnp.isinf(self) if not is_integral(self.dtype, True) else jnp.zeros(self.shape, bool)


@lowers(aten.isfinite.default)
def isfinite(self):
    return jnp.isfinite(self) if not is_integral(self.dtype, True) else jnp.ones(self.shape, bool)


@lowers(aten.isposinf.default)
def isposinf(self):
    return self == jnp.inf if not is_integral(self.dtype, True) else jnp.zeros(self.shape, bool)


@lowers(aten.isneginf.default)
def isneginf(self):
    return self == -jnp.inf if not is_integral(self.dtype, True) else jnp.zeros(self.shape, bool)


@lowers(aten.nan_to_num.default)
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    if is_integral(self.dtype, include_bool=True):
        return self
    info = jnp.finfo(self.dtype)
    nan = 0.0 if nan is None else nan
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf
    result = jnp.where(jnp.isnan(self), cast_scalar(nan, self.dtype), self)
    result = jnp.where(self == jnp.inf, cast_scalar(posinf, self.dtype), result)
    return jnp.where(self == -jnp.inf, cast_scalar(neginf, self.dtype), result)


# ----------------------------------------------------------------------------- add / sub / mul


def _is_one(value) -> bool:
    return isinstance(value, (int, float)) and value == 1


def _same_16_bit_tensors(a, b) -> bool:
    return a.dtype == b.dtype and a.dtype in (jnp.bfloat16, jnp.float16) \
        and jnp.ndim(a) > 0 and jnp.ndim(b) > 0


def _add(self, other, alpha, *, scalar_other: bool, subtract: bool = False):
    if not scalar_other and _is_one(alpha) and _same_16_bit_tensors(self, other):
        # The sum of two 16-bit floats rounded once from float32 is the sum rounded once
        # from the exact value (float32 holds it to far below half a 16-bit ulp): the same
        # bits as opmath's, in the inputs' dtype. In a compiled bf16 step the residual add
        # then reads the projection's bf16 result directly, and XLA's TPU compiler fuses the
        # add and the next RMSNorm's statistics into the projection's dot, as it does for the
        # JAX reference; through opmath's float32 round trip the dot wrote its result back
        # in float32 (W1 for a v5e: a float32 [1024, 512] and one more fusion per projection).
        return jnp.subtract(self, other) if subtract else jnp.add(self, other)
    if scalar_other:
        dtype, compute, (a,), (b,) = promote(self, scalars=[other])
    else:
        dtype, compute, (a, b), _ = promote(self, other)
    if dtype == jnp.bool_:
        return jnp.logical_or(a, b)
    if not _is_one(alpha):
        b = b * cast_scalar(alpha, compute)
    return (a - b if subtract else a + b).astype(dtype)


@lowers(aten.add.Tensor)
def add_tensor(self, other, *, alpha=1):
    return _add(self, other, alpha, scalar_other=False)


@lowers(aten.add.Scalar)
def add_scalar(self, other, alpha=1):
    return _add(self, other, alpha, scalar_other=True)


@lowers(aten.sub.Tensor)
def sub_tensor(self, other, *, alpha=1):
    return _add(self, other, alpha, scalar_other=False, subtract=True)


@lowers(aten.sub.Scalar)
def sub_scalar(self, other, alpha=1):
    return _add(self, other, alpha, scalar_other=True, subtract=True)


@lowers(aten.rsub.Tensor)
def rsub_tensor(self, other, *, alpha=1):
    return _add(other, self, alpha, scalar_other=False, subtract=True)


@lowers(aten.rsub.Scalar)
def rsub_scalar(self, other, alpha=1):
    dtype, compute, (a,), (b,) = promote(self, scalars=[other])
    if not _is_one(alpha):
        a = a * cast_scalar(alpha, compute)
    return (b - a).astype(dtype)


def _binary(self, other, compute_fn, *, scalar_other=False, to_float=False, name="op"):
    """Promote ``self`` and ``other`` the PyTorch way, compute in opmath, cast back."""
    if scalar_other:
        dtype, _, (a,), (b,) = promote(self, scalars=[other], to_float=to_float)
    else:
        dtype, _, (a, b), _ = promote(self, other, to_float=to_float)
    return compute_fn(a, b).astype(dtype)


@lowers(aten.mul.Tensor)
def mul_tensor(self, other):
    if self.dtype == jnp.bool_ and other.dtype == jnp.bool_:
        return jnp.logical_and(self, other)
    if self.dtype == other.dtype and self.dtype in (jnp.bfloat16, jnp.float16) \
            and self.ndim and other.ndim:
        # The product of two 16-bit floats is exact in float32, so rounding it once gives what
        # opmath's float32 product rounded back gives: the same bits, in the inputs' dtype.
        # Differentiated by JAX (a compiled step), its residuals then stay 16-bit too; the
        # opmath form kept both float32 upcasts alive until the backward (W1 bf16 for a v5e:
        # two float32 [1024, 1408] tensors per layer, the SwiGLU product's operands).
        return jnp.multiply(self, other)
    return _binary(self, other, jnp.multiply)


@lowers(aten.mul.Scalar)
def mul_scalar(self, other):
    return _binary(self, other, jnp.multiply, scalar_other=True)


# ----------------------------------------------------------------------------- division


def _div_trunc(a, b):
    if is_integral(a.dtype, include_bool=True):
        return lax.div(*jnp.broadcast_arrays(a, b))
    return jnp.trunc(a / b)


def _div_floor(a, b):
    """PyTorch's floor division: Python semantics for integers, fmod-corrected for floats."""
    if is_integral(a.dtype, include_bool=True):
        quotient = lax.div(*jnp.broadcast_arrays(a, b))
        remainder = fmod(a, b)
        needs_correction = (remainder != 0) & ((remainder < 0) != (b < 0))
        return quotient - needs_correction.astype(a.dtype)
    # The float path of PyTorch's div_floor_floating: exact on values where floor(a / b) is not.
    mod = fmod(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floored = jnp.floor(div)
    floored = jnp.where(div - floored > 0.5, floored + 1, floored)
    floored = jnp.where(div == 0, jnp.copysign(jnp.zeros_like(div), a / b), floored)
    return jnp.where(b == 0, a / b, floored)


def _div(self, other, rounding_mode, scalar_other):
    if rounding_mode is None:
        return _binary(self, other, jnp.divide, scalar_other=scalar_other, to_float=True)
    if rounding_mode == "trunc" and not scalar_other and jnp.ndim(other) > 0:
        dtype = result_dtype(self, other)
        if dtype in (jnp.bfloat16, jnp.float16):
            # Between two bf16/f16 tensors PyTorch rounds the quotient before truncating it
            # (a scalar divisor keeps the float32 quotient).
            return _binary(self, other, lambda a, b: jnp.trunc((a / b).astype(dtype)),
                           scalar_other=scalar_other)
    compute = {"trunc": _div_trunc, "floor": _div_floor}.get(rounding_mode)
    if compute is None:
        raise ValueError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' "
                         f"but found '{rounding_mode}'")
    return _binary(self, other, compute, scalar_other=scalar_other)


@lowers(aten.div.Tensor)
def div_tensor(self, other):
    return _div(self, other, None, False)


@lowers(aten.div.Scalar)
def div_scalar(self, other):
    return _div(self, other, None, True)


@lowers(aten.div.Tensor_mode)
def div_tensor_mode(self, other, *, rounding_mode=None):
    return _div(self, other, rounding_mode, False)


@lowers(aten.div.Scalar_mode)
def div_scalar_mode(self, other, *, rounding_mode=None):
    return _div(self, other, rounding_mode, True)


@lowers(aten.floor_divide.default)
def floor_divide(self, other):
    return _div(self, other, "floor", False)


@lowers(aten.floor_divide.Scalar)
def floor_divide_scalar(self, other):
    return _div(self, other, "floor", True)


def _remainder(a, b):
    # Python's modulo: the result takes the sign of the divisor.
    mod = fmod(a, b)
    return jnp.where((mod != 0) & ((mod < 0) != (b < 0)), mod + b, mod)


@lowers(aten.remainder.Tensor)
def remainder_tensor(self, other):
    return _binary(self, other, _remainder)


@lowers(aten.remainder.Scalar)
def remainder_scalar(self, other):
    return _binary(self, other, _remainder, scalar_other=True)


@lowers(aten.remainder.Scalar_Tensor)
def remainder_scalar_tensor(self, other):
    return _binary(other, self, lambda b, a: _remainder(a, b), scalar_other=True)


@lowers(aten.fmod.Tensor)
def fmod_tensor(self, other):
    return _binary(self, other, fmod)


@lowers(aten.fmod.Scalar)
def fmod_scalar(self, other):
    return _binary(self, other, fmod, scalar_other=True)


# ----------------------------------------------------------------------------- power


def _int_pow(base, exponent):
    """Integer power with PyTorch's rules for negative exponents (no error, no float)."""
    result = jnp.power(base, jnp.maximum(exponent, 0))
    negative = exponent < 0
    odd = (exponent % 2) != 0
    special_value = jnp.where(base == 1, 1, jnp.where(base == -1, jnp.where(odd, -1, 1), 0))
    return jnp.where(negative, special_value.astype(result.dtype), result)


def _pow(a, b):
    if is_integral(a.dtype, include_bool=True):
        return _int_pow(a, b)
    dtype = jnp.result_type(a, b)
    if jnp.issubdtype(dtype, jnp.floating):
        return scalar_power.ieee_pow(jnp.asarray(a, dtype), jnp.asarray(b, dtype))
    return jnp.power(a, b)


@lowers(aten.pow.Tensor_Tensor)
def pow_tensor_tensor(self, exponent):
    return _binary(self, exponent, _pow)


@lowers(aten.pow.Tensor_Scalar)
def pow_tensor_scalar(self, exponent):
    if isinstance(exponent, int) and not isinstance(exponent, bool) \
            and not is_integral(result_dtype(self, scalars=[exponent]), include_bool=True):
        # A static integer exponent: repeated multiplication, as exact as PyTorch's.
        dtype = result_dtype(self, scalars=[exponent])
        base = self.astype(opmath_dtype(dtype))
        return lax.integer_pow(base, exponent).astype(dtype)
    return _binary(self, exponent, _pow, scalar_other=True)


# static_floats: the base arrives as a Python number (in eager mode too, as in a compiled
# step), its double value known when the program is built; an eager call compiles once per base.
@lowers(aten.pow.Scalar, static_floats=True)
def pow_scalar(self, exponent):
    dtype, compute, (e,), _ = promote(exponent, scalars=[self])
    if compute == jnp.float32 and scalar_power.is_host_base(self):
        # Whole exponents (a step count) by float-float multiplication: XLA's pow is
        # exp(e * log(b)), 10-80 ulps off on a TPU, and optimizers subtract beta**step from 1.
        return scalar_power.power(self, e).astype(dtype)
    return _binary(exponent, self, lambda e, b: _pow(b, e), scalar_other=True)


# ----------------------------------------------------------------------------- other binary


@lowers(aten.atan2.default)
def atan2(self, other):
    return _binary(self, other, jnp.arctan2, to_float=True)


@lowers(aten.hypot.default)
def hypot(self, other):
    return _binary(self, other, jnp.hypot)


@lowers(aten.copysign.Tensor)
def copysign(self, other):
    return _binary(self, other, jnp.copysign, to_float=True)


@lowers(aten.copysign.Scalar)
def copysign_scalar(self, other):
    return _binary(self, other, jnp.copysign, scalar_other=True, to_float=True)


@lowers(aten.nextafter.default)
def nextafter(self, other):
    dtype = result_dtype(self, other)
    return jnp.nextafter(self.astype(dtype), other.astype(dtype))


def _xlogy(x, y):
    # 0 * log(0) is 0, but a NaN ``y`` still propagates.
    return jnp.where(jnp.isnan(y), jnp.nan, jnp.where(x == 0, 0, x * jnp.log(y)))


@lowers(aten.xlogy.Tensor)
def xlogy(self, other):
    return _binary(self, other, _xlogy, to_float=True)


@lowers(aten.xlogy.Scalar_Other)
def xlogy_scalar_other(self, other):
    return _binary(self, other, _xlogy, scalar_other=True, to_float=True)


@lowers(aten.xlogy.Scalar_Self)
def xlogy_scalar_self(self, other):
    return _binary(other, self, lambda y, x: _xlogy(x, y), scalar_other=True, to_float=True)


@lowers(aten.special_xlog1py.default)
def xlog1py(self, other):
    return _binary(self, other, lambda x, y: jnp.where(
        jnp.isnan(y), jnp.nan, jnp.where(x == 0, 0, x * jnp.log1p(y))), to_float=True)


@lowers(aten.maximum.default)
def maximum(self, other):
    return _binary(self, other, jnp.maximum)


@lowers(aten.minimum.default)
def minimum(self, other):
    return _binary(self, other, jnp.minimum)


@lowers(aten.fmax.default)
def fmax(self, other):
    return _binary(self, other, jnp.fmax)


@lowers(aten.fmin.default)
def fmin(self, other):
    return _binary(self, other, jnp.fmin)


def _lerp(start, end, weight):
    # PyTorch's two-sided formula keeps lerp exact at both ends (weight 0 and 1).
    diff = end - start
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))


@lowers(aten.lerp.Scalar)
def lerp_scalar(self, end, weight):
    dtype, compute, (a, b), _ = promote(self, end)
    return _lerp(a, b, cast_scalar(weight, compute)).astype(dtype)


@lowers(aten.lerp.Tensor)
def lerp_tensor(self, end, weight):
    dtype, compute, (a, b, w), _ = promote(self, end, weight)
    return _lerp(a, b, w).astype(dtype)


@lowers(aten.addcmul.default)
def addcmul(self, tensor1, tensor2, *, value=1):
    dtype = result_dtype(self, tensor1, tensor2)
    compute = opmath_dtype(dtype)
    s, t1, t2 = (t.astype(dtype).astype(compute) for t in (self, tensor1, tensor2))
    v = cast_scalar(value, compute)
    return (s + v * t1 * t2).astype(dtype)


@lowers(aten.addcdiv.default)
def addcdiv(self, tensor1, tensor2, *, value=1):
    dtype = result_dtype(self, tensor1, tensor2)
    if is_integral(dtype, include_bool=True):
        raise TypeError("addcdiv does not support integer division; use addcmul with 1/t2")
    compute = opmath_dtype(dtype)
    s, t1, t2 = (t.astype(dtype).astype(compute) for t in (self, tensor1, tensor2))
    return (s + cast_scalar(value, compute) * t1 / t2).astype(dtype)


def _clamp(self, low, high, scalar_bounds):
    if low is None and high is None:
        raise ValueError("torch.clamp: At least one of 'min' or 'max' must not be None")
    bounds = [b for b in (low, high) if b is not None]
    if scalar_bounds:
        dtype = result_dtype(self, scalars=bounds)
        compute = opmath_dtype(dtype)
        cast = lambda b: None if b is None else cast_scalar(b, dtype).astype(compute)  # noqa: E731
    else:
        dtype = result_dtype(self, *bounds)
        compute = opmath_dtype(dtype)
        cast = lambda b: None if b is None else b.astype(dtype).astype(compute)  # noqa: E731
    x = self.astype(dtype).astype(compute)
    low, high = cast(low), cast(high)
    # max then min, each NaN-propagating: PyTorch's order when min > max too. Selects rather
    # than maximum / minimum: JAX's gradient is then PyTorch's, which passes at the bounds
    # (``maximum`` would split a tie 1/2 : 1/2).
    if low is not None:
        x = jnp.where(x < low, low, x)
    if high is not None:
        x = jnp.where(x > high, high, x)
    return x.astype(dtype)


@lowers(aten.clamp.default)
def clamp(self, min=None, max=None):
    return _clamp(self, min, max, scalar_bounds=True)


@lowers(aten.clamp.Tensor)
def clamp_tensor(self, min=None, max=None):
    return _clamp(self, min, max, scalar_bounds=False)


@lowers(aten.clamp_min.default)
def clamp_min(self, min):
    return _clamp(self, min, None, scalar_bounds=True)


@lowers(aten.clamp_min.Tensor)
def clamp_min_tensor(self, min):
    return _clamp(self, min, None, scalar_bounds=False)


@lowers(aten.clamp_max.default)
def clamp_max(self, max):
    return _clamp(self, None, max, scalar_bounds=True)


@lowers(aten.clamp_max.Tensor)
def clamp_max_tensor(self, max):
    return _clamp(self, None, max, scalar_bounds=False)
