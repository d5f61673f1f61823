"""Activation functions and the backward ops autograd emits for them.

Each activation computes in opmath (bf16/f16 in float32) with PyTorch's formulas, including its
thresholds and the value a backward op gives exactly at a kink (``relu``'s gradient at 0 is 0,
``hardtanh``'s is 0 at both bounds), so gradients match PyTorch bit for bit where they can.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.scipy import special

from tpu_train.ops.conversion import cast_scalar, opmath_dtype, result_dtype
from tpu_train.ops.registry import aten, lowers


def _opmath(*tensors):
    """Cast tensors to their common dtype's opmath type; returns ``(dtype, compute, arrays)``."""
    dtype = result_dtype(*tensors)
    compute = opmath_dtype(dtype)
    return dtype, compute, [t.astype(dtype).astype(compute) for t in tensors]


@lowers(aten.relu.default)
def relu(self):
    if self.dtype == jnp.bool_:
        return self
    # A select, not ``maximum``: differentiated by JAX (a compiled step's loss graph), the
    # gradient at 0 is then 0 as in PyTorch's relu backward, not ``maximum``'s tie split 1/2.
    return jnp.where(self <= 0, jnp.zeros((), self.dtype), self)


@lowers(aten.threshold.default)
def threshold(self, threshold, value):
    dtype, compute, (x,) = _opmath(self)
    return jnp.where(x <= cast_scalar(threshold, compute), cast_scalar(value, compute),
                     x).astype(dtype)


@lowers(aten.threshold_backward.default)
def threshold_backward(grad_output, self, threshold):
    dtype, compute, (g, x) = _opmath(grad_output, self)
    return jnp.where(x <= cast_scalar(threshold, compute), 0, g).astype(dtype)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_COEFF = 0.044715


def _check_gelu_approximate(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate argument must be either none or tanh, got {approximate!r}")


@lowers(aten.gelu.default)
def gelu(self, *, approximate="none"):
    _check_gelu_approximate(approximate)
    dtype, _, (x,) = _opmath(self)
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (x + _GELU_TANH_COEFF * x * x * x)
        return (0.5 * x * (1 + jnp.tanh(inner))).astype(dtype)
    return (x * 0.5 * (1 + special.erf(x * math.sqrt(0.5)))).astype(dtype)


@lowers(aten.gelu_backward.default)
def gelu_backward(grad_output, self, *, approximate="none"):
    _check_gelu_approximate(approximate)
    dtype, _, (g, x) = _opmath(grad_output, self)
    if approximate == "tanh":
        x_sq = x * x
        inner = _SQRT_2_OVER_PI * (x + _GELU_TANH_COEFF * x_sq * x)
        tanh_inner = jnp.tanh(inner)
        left_derivative = 0.5 * (1 + tanh_inner)
        inner_derivative = _SQRT_2_OVER_PI * (1 + 3 * _GELU_TANH_COEFF * x_sq)
        right_derivative = 0.5 * x * (1 - tanh_inner * tanh_inner) * inner_derivative
        return (g * (left_derivative + right_derivative)).astype(dtype)
    cdf = 0.5 * (1 + special.erf(x * math.sqrt(0.5)))
    pdf = jnp.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return (g * (cdf + x * pdf)).astype(dtype)


@lowers(aten.silu.default)
def silu(self):
    dtype, compute, (x,) = _opmath(self)
    if compute != dtype:
        return _low_precision_silu(self.astype(dtype))
    return (x / (1 + jnp.exp(-x))).astype(dtype)


@jax.custom_vjp
def _low_precision_silu(x):
    """SiLU of a 16-bit tensor computed in float32 and rounded, whose derivative (JAX's, in a
    compiled step) keeps only ``x`` for the backward and recomputes the sigmoid there, as
    PyTorch's ``silu_backward`` does. JAX's own derivative of the float32 formula kept its
    float32 intermediates alive from the forward (W1 bf16 for a v5e: float32 [1024, 1408]
    tensors written in the forward and read in the backward of every layer)."""
    x32 = x.astype(jnp.float32)
    return (x32 / (1 + jnp.exp(-x32))).astype(x.dtype)


def _low_precision_silu_forward(x):
    return _low_precision_silu(x), x


def _low_precision_silu_backward(x, grad):
    # On the CPU client: PyTorch's silu_backward in float32, rounded once (its exact bits).
    # Elsewhere the same formula in x's dtype: XLA's TPU compiler computes such a chain in
    # float32 and rounds once at its end (excess precision; the float32 formula's value), and
    # without the explicit conversions it recomputes the derivative inside the SwiGLU's
    # backward dots instead of writing a [tokens, ffn] product of it to HBM (W1 bf16 for a
    # v5e: 1.584 -> 1.550 GB per step without memory-space prefetches). XLA's CPU compiler
    # would round every step to bf16 instead.
    return (jax.lax.platform_dependent(grad.astype(x.dtype), x, cpu=silu_backward,
                                       default=_silu_backward_in_dtype),)


def _silu_backward_in_dtype(grad_output, x):
    one = jnp.ones((), x.dtype)
    sigmoid = one / (one + jnp.exp(-x))
    return grad_output * sigmoid * (one + x * (one - sigmoid))


_low_precision_silu.defvjp(_low_precision_silu_forward, _low_precision_silu_backward)


@lowers(aten.silu_backward.default)
def silu_backward(grad_output, self):
    dtype, _, (g, x) = _opmath(grad_output, self)
    sigmoid = 1 / (1 + jnp.exp(-x))
    return (g * sigmoid * (1 + x * (1 - sigmoid))).astype(dtype)


@lowers(aten.sigmoid_backward.default)
def sigmoid_backward(grad_output, output):
    dtype, _, (g, y) = _opmath(grad_output, output)
    return (g * (1 - y) * y).astype(dtype)


@lowers(aten.tanh_backward.default)
def tanh_backward(grad_output, output):
    dtype, _, (g, y) = _opmath(grad_output, output)
    return (g * (1 - y * y)).astype(dtype)


@lowers(aten.elu.default)
def elu(self, alpha=1, scale=1, input_scale=1):
    dtype, compute, (x,) = _opmath(self)
    alpha, scale, input_scale = (cast_scalar(v, compute) for v in (alpha, scale, input_scale))
    negative = alpha * jnp.expm1(x * input_scale) * scale
    return jnp.where(x <= 0, negative, x * scale).astype(dtype)


@lowers(aten.elu_backward.default)
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    dtype, compute, (g, x) = _opmath(grad_output, self_or_result)
    alpha, scale, input_scale = (cast_scalar(v, compute) for v in (alpha, scale, input_scale))
    if is_result:
        negative = g * input_scale * (x + alpha * scale)
    else:
        negative = g * input_scale * alpha * scale * jnp.exp(x * input_scale)
    return jnp.where(x <= 0, negative, g * scale).astype(dtype)


@lowers(aten.leaky_relu.default)
def leaky_relu(self, negative_slope=0.01):
    dtype, compute, (x,) = _opmath(self)
    return jnp.where(x > 0, x, x * cast_scalar(negative_slope, compute)).astype(dtype)


@lowers(aten.leaky_relu_backward.default)
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    dtype, compute, (g, x) = _opmath(grad_output, self)
    return jnp.where(x > 0, g, g * cast_scalar(negative_slope, compute)).astype(dtype)


@lowers(aten.hardtanh.default)
def hardtanh(self, min_val=-1, max_val=1):
    dtype, compute, (x,) = _opmath(self)
    low, high = cast_scalar(min_val, compute), cast_scalar(max_val, compute)
    # Selects: JAX's gradient is then PyTorch's, zero at either bound (see relu).
    return jnp.where(x <= low, low, jnp.where(x >= high, high, x)).astype(dtype)


@lowers(aten.hardtanh_backward.default)
def hardtanh_backward(grad_output, self, min_val, max_val):
    dtype, compute, (g, x) = _opmath(grad_output, self)
    low, high = cast_scalar(min_val, compute), cast_scalar(max_val, compute)
    return jnp.where((x <= low) | (x >= high), 0, g).astype(dtype)


@lowers(aten.softplus.default)
def softplus(self, beta=1, threshold=20):
    dtype, compute, (x,) = _opmath(self)
    beta, threshold = cast_scalar(beta, compute), cast_scalar(threshold, compute)
    scaled = x * beta
    return jnp.where(scaled > threshold, x, jnp.log1p(jnp.exp(scaled)) / beta).astype(dtype)


@lowers(aten.softplus_backward.default)
def softplus_backward(grad_output, self, beta, threshold):
    dtype, compute, (g, x) = _opmath(grad_output, self)
    beta, threshold = cast_scalar(beta, compute), cast_scalar(threshold, compute)
    scaled_exp = jnp.exp(x * beta)
    return jnp.where(x * beta > threshold, g, g * scaled_exp / (scaled_exp + 1)).astype(dtype)


@lowers(aten.hardsigmoid.default)
def hardsigmoid(self):
    dtype, _, (x,) = _opmath(self)
    return (jnp.minimum(jnp.maximum(x + 3, 0), 6) / 6).astype(dtype)


@lowers(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(grad_output, self):
    dtype, _, (g, x) = _opmath(grad_output, self)
    return jnp.where((x > -3) & (x < 3), g / 6, 0).astype(dtype)


@lowers(aten.hardswish.default)
def hardswish(self):
    dtype, _, (x,) = _opmath(self)
    return (x * jnp.minimum(jnp.maximum(x + 3, 0), 6) / 6).astype(dtype)


@lowers(aten.hardswish_backward.default)
def hardswish_backward(grad_output, self):
    dtype, _, (g, x) = _opmath(grad_output, self)
    middle = g * ((x / 3) + 0.5)
    return jnp.where(x <= -3, 0, jnp.where(x < 3, middle, g)).astype(dtype)


def _softplus_default(x):
    return jnp.where(x > 20, x, jnp.log1p(jnp.exp(x)))


@lowers(aten.mish.default)
def mish(self):
    dtype, _, (x,) = _opmath(self)
    return (x * jnp.tanh(_softplus_default(x))).astype(dtype)


@lowers(aten.mish_backward.default)
def mish_backward(grad_output, self):
    dtype, _, (g, x) = _opmath(grad_output, self)
    sigmoid = 1 / (1 + jnp.exp(-x))
    tanh_softplus = jnp.tanh(_softplus_default(x))
    return (g * (tanh_softplus + x * sigmoid * (1 - tanh_softplus * tanh_softplus))).astype(dtype)


@lowers(aten.glu.default)
def glu(self, dim=-1):
    dtype, _, (x,) = _opmath(self)
    first, second = jnp.split(x, 2, axis=dim)
    return (first * (1 / (1 + jnp.exp(-second)))).astype(dtype)


@lowers(aten.glu_backward.default)
def glu_backward(grad_output, self, dim):
    dtype, _, (g, x) = _opmath(grad_output, self)
    first, second = jnp.split(x, 2, axis=dim)
    sigmoid = 1 / (1 + jnp.exp(-second))
    grad_first = g * sigmoid
    grad_second = g * first * sigmoid * (1 - sigmoid)
    return jnp.concatenate([grad_first, grad_second], axis=dim).astype(dtype)


@lowers(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(self):
    dtype, _, (x,) = _opmath(self)
    # log σ(x) = min(x, 0) - log1p(exp(-|x|)); the buffer holds exp(-|x|) as on CPU.
    buffer = jnp.exp(-jnp.abs(x))
    output = jnp.minimum(x, 0) - jnp.log1p(buffer)
    return output.astype(dtype), buffer.astype(dtype)


@lowers(aten.log_sigmoid_backward.default)
def log_sigmoid_backward(grad_output, self, buffer):
    dtype, _, (g, x) = _opmath(grad_output, self)
    return (g * (1 / (1 + jnp.exp(x)))).astype(dtype)


@lowers(aten.hardshrink.default)
def hardshrink(self, lambd=0.5):
    dtype, compute, (x,) = _opmath(self)
    lambd = cast_scalar(lambd, compute)
    return jnp.where((x >= -lambd) & (x <= lambd), 0, x).astype(dtype)


@lowers(aten.softshrink.default)
def softshrink(self, lambd=0.5):
    dtype, compute, (x,) = _opmath(self)
    lambd = cast_scalar(lambd, compute)
    return jnp.where(x > lambd, x - lambd, jnp.where(x < -lambd, x + lambd, 0)).astype(dtype)


@lowers(aten.hardshrink_backward.default, aten.softshrink_backward.default)
def shrink_backward(grad_output, self, lambd):
    """Both shrinks pass the gradient where ``|x| > lambd`` and drop it inside the band."""
    dtype, compute, (g, x) = _opmath(grad_output, self)
    lambd = cast_scalar(lambd, compute)
    return jnp.where((x >= -lambd) & (x <= lambd), 0, g).astype(dtype)
