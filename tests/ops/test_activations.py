"""Activation lowerings and their backward ops against PyTorch on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches
from tests.ops.test_pointwise import assert_matches_jitted, make, tolerance
from tests.tolerances import ELEMENTWISE_ULPS
from tpu_train.ops import activations  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten

DTYPES = [torch.float32, torch.bfloat16]
# An activation (or its derivative, times the incoming gradient) is elementwise: at most three
# transcendental functions (mish: x * tanh(log1p(exp(x))); its backward, gelu's) and a few
# correctly rounded operations, each possibly rounded to a 16-bit dtype; intermediates of the
# inputs' size (5) where an output cancels to near zero (tests/tolerances.py elementwise_rtol).
ACTIVATION_ULPS = 3 * ELEMENTWISE_ULPS["transcendental"] + 3


def activation_tolerance(dtype):
    return tolerance(dtype, ACTIVATION_ULPS, roundings=4, scale=5)


def inputs(dtype, shape=(6, 8)):
    """Random values plus the kinks and thresholds where activations are piecewise."""
    x = make(shape, dtype, -5, 5).flatten()
    edges = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0, -3.0, 20.0, 25.0, -25.0, 0.5]).to(dtype)
    return torch.cat([x, edges])


FORWARD = [
    (aten.relu.default, ()), (aten.gelu.default, ()), (aten.silu.default, ()),
    (aten.threshold.default, (0.5, -2.0)), (aten.elu.default, (1.5, 1.2, 0.7)),
    (aten.leaky_relu.default, (0.2,)), (aten.hardtanh.default, (-1.0, 3.0)),
    (aten.softplus.default, (2.0, 10.0)), (aten.hardsigmoid.default, ()),
    (aten.hardswish.default, ()), (aten.mish.default, ()), (aten.hardshrink.default, (0.5,)),
    (aten.softshrink.default, (0.5,)), (aten.log_sigmoid_forward.default, ()),
]


@pytest.mark.parametrize("op, args", FORWARD, ids=lambda v: str(v) if not isinstance(v, tuple)
                         else "")
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(op, args, dtype):
    tol = activation_tolerance(dtype)
    assert_lowering_matches(op, inputs(dtype), *args, **tol)


def test_gelu_tanh_and_relu_integers():
    x = inputs(torch.float32)
    assert_lowering_matches(aten.gelu.default, x, approximate="tanh")
    assert_lowering_matches(aten.relu.default, make((5,), torch.int64))
    assert_matches_jitted(aten.leaky_relu.default, x, 0.1)
    assert_matches_jitted(aten.elu.default, x, 0.9, 1.1, 1.0)


BACKWARD = [
    (aten.gelu_backward.default, (), {"approximate": "none"}),
    (aten.gelu_backward.default, (), {"approximate": "tanh"}),
    (aten.silu_backward.default, (), {}),
    (aten.threshold_backward.default, (0.0,), {}),
    (aten.leaky_relu_backward.default, (0.2, False), {}),
    (aten.hardtanh_backward.default, (-1.0, 1.0), {}),
    (aten.softplus_backward.default, (1.0, 20.0), {}),
    (aten.hardsigmoid_backward.default, (), {}),
    (aten.hardswish_backward.default, (), {}),
    (aten.mish_backward.default, (), {}),
]


@pytest.mark.parametrize("op, args, kwargs", BACKWARD, ids=[str(b[0]) for b in BACKWARD])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(op, args, kwargs, dtype):
    x = inputs(dtype)
    grad = make(x.shape, dtype, seed=4)
    tol = activation_tolerance(dtype)
    assert_lowering_matches(op, grad, x, *args, **tol, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_from_outputs(dtype):
    x = inputs(dtype)
    grad = make(x.shape, dtype, seed=5)
    tol = activation_tolerance(dtype)
    assert_lowering_matches(aten.sigmoid_backward.default, grad, torch.sigmoid(x), **tol)
    assert_lowering_matches(aten.tanh_backward.default, grad, torch.tanh(x), **tol)
    for is_result in (False, True):
        source = torch.ops.aten.elu(x, 1.5, 1.2, 0.7) if is_result else x
        assert_lowering_matches(aten.elu_backward.default, grad, 1.5, 1.2, 0.7, is_result, source,
                                **tol)
    out, buffer = torch.ops.aten.log_sigmoid_forward(x)
    assert_lowering_matches(aten.log_sigmoid_backward.default, grad, x, buffer, **tol)


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_glu(dim):
    x = make((4, 6, 2), torch.float32)
    assert_lowering_matches(aten.glu.default, x, dim)
    grad = make(torch.ops.aten.glu(x, dim).shape, torch.float32, seed=3)
    assert_lowering_matches(aten.glu_backward.default, grad, x, dim)


@pytest.mark.parametrize("op", [aten.hardshrink_backward.default, aten.softshrink_backward.default])
def test_shrink_backward(op):
    x = inputs(torch.float32)
    g = make(x.shape, torch.float32, -2, 2)
    assert_lowering_matches(op, g, x, 0.5, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_jax_derivative_of_16_bit_silu_is_pytorchs_backward(dtype):
    """A compiled step differentiates the silu lowering with JAX: for 16-bit inputs its
    custom derivative (only the input kept for the backward) must give PyTorch's gradient."""
    import jax
    import numpy as np

    from tpu_train.ops.activations import silu

    x = inputs(dtype)
    grad = make(x.shape, dtype, seed=6)
    leaf = x.clone().requires_grad_(True)
    torch.nn.functional.silu(leaf).backward(grad)

    def as_jax(t):
        return jax.numpy.asarray(t.float().numpy()).astype(str(dtype).split(".")[1])

    out, pullback = jax.vjp(silu, as_jax(x))
    (got,) = pullback(as_jax(grad))
    assert out.dtype == got.dtype == as_jax(x).dtype
    tol = activation_tolerance(dtype)
    torch.testing.assert_close(torch.from_numpy(np.array(got.astype("float32"))),
                               leaf.grad.float(), **tol)


def test_16_bit_silu_derivative_is_float32_on_the_cpu_client_and_16_bit_elsewhere():
    """The derivative is PyTorch's float32 formula rounded once where XLA rounds every 16-bit
    op (the CPU client: the exact bits checked above); for other platforms it is lowered in
    the input's dtype, which XLA's TPU compiler computes in float32 and rounds once, without
    conversions that make it write the derivative's product out instead of fusing it."""
    import jax
    import jax.numpy as jnp

    from tpu_train.ops.activations import silu

    x = jnp.linspace(-4, 4, 256, dtype=jnp.bfloat16).reshape(2, 128)

    def derivative(x):
        return jax.vjp(silu, x)[1](jnp.ones_like(x))[0]

    def float32_converts(platform):
        text = jax.jit(derivative).trace(x).lower(lowering_platforms=(platform,)).as_text()
        return text.count("-> tensor<2x128xf32>")

    assert float32_converts("cpu") > 0
    assert float32_converts("tpu") == 0
