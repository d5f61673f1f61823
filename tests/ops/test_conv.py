"""Convolution, pooling, padding and upsampling lowerings against PyTorch on CPU."""

import jax.numpy as jnp
import pytest
import torch

import math

from tests.ops.lowering_check import assert_lowering_matches, to_jax, to_torch
from tests.tolerances import elementwise_rtol, rtol_for
from tpu_train.ops import conv as conv_lowerings

aten = torch.ops.aten


def tolerance(dtype, n):
    """assert_close's (atol, rtol) for sums of ``n`` products of unit-normal values (a
    convolution: kernel volume x input channels per group; its input gradient: kernel volume x
    output channels; its weight / bias gradient: batch x output positions; a pooling window)
    (tests/tolerances.py): rtol_for(float32, n); bf16 accumulates in float32 and rounds the
    output once (elementwise_rtol(bf16)). An output's size is ~sqrt(n): atol is rtol at that
    size, for outputs that cancel to near zero."""
    rtol = rtol_for(torch.float32, n) + (0.0 if dtype == torch.float32 else elementwise_rtol(dtype))
    return dict(atol=rtol * math.sqrt(n), rtol=rtol)


def conv_reduction(x_shape, w_shape, out_shape, transposed, groups):
    """The longest reduction of a convolution and its backward: kernel volume x the input
    (forward) or output (input gradient) channels per group, or batch x output positions
    (weight and bias gradients), plus one for the bias."""
    kernel = math.prod(w_shape[2:])
    in_channels, out_channels = x_shape[1] // groups, out_shape[1] // groups
    return max(kernel * max(in_channels, out_channels), out_shape[0] * math.prod(out_shape[2:])) + 1


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + sum(shape) + len(shape))
    return torch.randn(*shape, generator=g).to(dtype)


# --- convolution -----------------------------------------------------------------------------

CONV_CASES = [
    # (input shape, weight shape, stride, padding, dilation, transposed, output_padding, groups)
    ((2, 4, 9), (6, 4, 3), [1], [0], [1], False, [0], 1),
    ((2, 4, 9), (6, 2, 3), [2], [1], [2], False, [0], 2),
    ((2, 3, 8, 7), (4, 3, 3, 3), [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
    ((1, 4, 9, 8), (8, 1, 3, 2), [2, 1], [0, 1], [1, 2], False, [0, 0], 4),
    ((1, 2, 5, 4, 6), (3, 2, 2, 3, 2), [1, 2, 1], [1, 0, 1], [1, 1, 2], False, [0, 0, 0], 1),
    ((2, 4, 5, 5), (4, 3, 3, 3), [2, 2], [1, 1], [1, 1], True, [1, 0], 1),
    ((2, 4, 5, 6), (4, 2, 3, 2), [2, 3], [0, 1], [2, 1], True, [1, 2], 2),
    ((2, 4, 7), (4, 5, 3), [1], [2], [1], True, [0], 1),  # padding wider than the kernel reach
    ((1, 2, 3, 4, 3), (2, 2, 2, 2, 3), [2, 1, 2], [0, 1, 1], [1, 1, 1], True, [1, 0, 0], 1),
]


@pytest.mark.parametrize("index", range(len(CONV_CASES)))
def test_convolution_forward_and_backward(index):
    in_shape, w_shape, stride, padding, dilation, transposed, output_padding, groups = CONV_CASES[index]
    with_bias = index % 2 == 0
    x, w = rand(*in_shape), rand(*w_shape, seed=1)
    out_channels = w_shape[1] * groups if transposed else w_shape[0]
    bias = rand(out_channels, seed=2) if with_bias else None
    args = (stride, padding, dilation, transposed, output_padding, groups)
    out = aten.convolution(x, w, bias, *args)
    tol = tolerance(torch.float32, conv_reduction(in_shape, w_shape, out.shape, transposed, groups))
    assert_lowering_matches(aten.convolution.default, x, w, bias, *args, **tol)
    grad = rand(*out.shape, seed=3)
    bias_sizes = [out_channels] if with_bias else None
    mask = [True, True, with_bias]
    expected = aten.convolution_backward(grad, x, w, bias_sizes, *args, mask)
    got = conv_lowerings.convolution_backward(to_jax(grad), to_jax(x), to_jax(w), bias_sizes, *args, mask)
    for g, e in zip(got, expected):
        if e is None:
            assert g is None
        else:
            torch.testing.assert_close(to_torch(g, e.dtype), e, **tol)


def test_convolution_bf16_and_masked_backward():
    x, w, b = rand(2, 4, 8, 8, dtype=torch.bfloat16), rand(6, 4, 3, 3, dtype=torch.bfloat16), rand(6).bfloat16()
    args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    # forward: 4 channels x 3 x 3; weight gradient: 2 x 8 x 8 positions (+1: the bias)
    assert_lowering_matches(aten.convolution.default, x, w, b, *args, **tolerance(torch.bfloat16, 4 * 9 + 1))
    grad = rand(2, 6, 8, 8, dtype=torch.bfloat16, seed=4)
    got = conv_lowerings.convolution_backward(to_jax(grad), to_jax(x), to_jax(w), [6], *args, [False, True, False])
    expected = aten.convolution_backward(grad, x, w, [6], *args, [False, True, False])
    assert got[0] is None and got[2] is None
    torch.testing.assert_close(to_torch(got[1], torch.bfloat16), expected[1], **tolerance(torch.bfloat16, 2 * 64))


# --- max pooling -----------------------------------------------------------------------------

MAX_POOL_CASES = [
    # (shape, kernel, stride, padding, dilation, ceil_mode)
    ((2, 3, 8, 8), [2, 2], [2, 2], [0, 0], [1, 1], False),
    ((2, 3, 9, 7), [3, 3], [2, 2], [1, 1], [1, 1], False),
    ((1, 2, 9, 7), [3, 2], [2, 2], [1, 0], [1, 1], True),
    ((1, 2, 10, 9), [3, 3], [1, 2], [1, 1], [2, 2], False),
    ((3, 7, 7), [2, 2], [], [0], [1], True),  # unbatched, default stride
]


@pytest.mark.parametrize("case", MAX_POOL_CASES)
def test_max_pool2d_with_indices(case):
    shape, kernel, stride, padding, dilation, ceil_mode = case
    x = rand(*shape)
    args = (kernel, stride, padding, dilation, ceil_mode)
    assert_lowering_matches(aten.max_pool2d_with_indices.default, x, *args, atol=0, rtol=0)
    out, indices = aten.max_pool2d_with_indices(x, *args)
    grad = rand(*out.shape, seed=5)
    assert_lowering_matches(aten.max_pool2d_with_indices_backward.default, grad, x, kernel, stride or kernel,
                            padding, dilation, ceil_mode, indices)


def test_max_pool_ties_infinities_and_nans_pick_torch_indices():
    x = torch.tensor([[[[1.0, 1.0, 0.0, 2.0],
                        [1.0, 0.0, 2.0, 2.0],
                        [float("-inf"), float("-inf"), float("nan"), 3.0],
                        [float("-inf"), float("-inf"), 1.0, float("nan")]]]])
    for padding in ([0, 0], [1, 1]):
        assert_lowering_matches(aten.max_pool2d_with_indices.default, x, [2, 2], [2, 2], padding, [1, 1], True,
                                atol=0, rtol=0)


def test_max_pool_integer_and_bf16_inputs():
    x = torch.randint(-5, 5, (1, 2, 6, 6), generator=torch.Generator().manual_seed(0)).to(torch.int64)
    assert_lowering_matches(aten.max_pool2d_with_indices.default, x.float(), [3, 3], [3, 3], [0, 0], [1, 1],
                            False, atol=0, rtol=0)
    assert_lowering_matches(aten.max_pool2d_with_indices.default, rand(1, 2, 6, 6).bfloat16(), [2, 2], [1, 1],
                            [1, 1], [1, 1], False, atol=0, rtol=0)


def test_max_pool3d_with_indices():
    x = rand(1, 2, 5, 6, 4)
    args = ([2, 3, 2], [2, 2, 1], [1, 1, 0], [1, 1, 1], True)
    assert_lowering_matches(aten.max_pool3d_with_indices.default, x, *args, atol=0, rtol=0)
    out, indices = aten.max_pool3d_with_indices(x, *args)
    assert_lowering_matches(aten.max_pool3d_with_indices_backward.default, rand(*out.shape, seed=1), x, *args,
                            indices)


# --- average pooling -------------------------------------------------------------------------

AVG_POOL_CASES = [
    # (shape, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    ((2, 3, 8, 8), [2, 2], [2, 2], [0, 0], False, True, None),
    ((2, 3, 9, 7), [3, 3], [2, 2], [1, 1], False, True, None),
    ((2, 3, 9, 7), [3, 3], [2, 2], [1, 1], False, False, None),
    ((1, 2, 9, 7), [3, 2], [2, 2], [1, 1], True, True, None),
    ((1, 2, 9, 7), [3, 2], [2, 2], [1, 1], True, False, None),
    ((1, 2, 6, 6), [3, 3], [1, 1], [1, 1], False, True, 4),
    ((3, 7, 7), [2, 2], [], [0], True, True, None),
]


@pytest.mark.parametrize("case", AVG_POOL_CASES)
def test_avg_pool2d(case):
    shape, kernel, stride, padding, ceil_mode, count_include_pad, divisor = case
    x = rand(*shape)
    args = (kernel, stride, padding, ceil_mode, count_include_pad, divisor)
    assert_lowering_matches(aten.avg_pool2d.default, x, *args)
    out = aten.avg_pool2d(x, *args)
    assert_lowering_matches(aten.avg_pool2d_backward.default, rand(*out.shape, seed=1), x, kernel,
                            stride or kernel, padding, ceil_mode, count_include_pad, divisor)


def test_avg_pool2d_bf16_and_avg_pool3d():
    assert_lowering_matches(aten.avg_pool2d.default, rand(1, 2, 6, 6).bfloat16(), [2, 2], [2, 2], [1, 1], False,
                            True, None, **tolerance(torch.bfloat16, 4))  # 2 x 2 windows
    x = rand(1, 2, 5, 6, 4)
    args = ([2, 3, 2], [2, 2, 1], [1, 1, 0], True, False, None)
    assert_lowering_matches(aten.avg_pool3d.default, x, *args)
    out = aten.avg_pool3d(x, *args)
    assert_lowering_matches(aten.avg_pool3d_backward.default, rand(*out.shape, seed=1), x, *args)


@pytest.mark.parametrize("in_hw,out_hw", [((8, 8), (4, 4)), ((7, 9), (3, 4)), ((4, 6), (6, 7))])
def test_adaptive_avg_pool2d(in_hw, out_hw):
    x = rand(2, 3, *in_hw)
    assert_lowering_matches(aten._adaptive_avg_pool2d.default, x, list(out_hw))
    assert_lowering_matches(aten._adaptive_avg_pool2d_backward.default, rand(2, 3, *out_hw, seed=1), x)
    assert_lowering_matches(aten._adaptive_avg_pool2d.default, x[0], list(out_hw))


def test_adaptive_avg_pool3d():
    x = rand(1, 2, 5, 6, 4)
    assert_lowering_matches(aten._adaptive_avg_pool3d.default, x, [2, 3, 3])
    assert_lowering_matches(aten._adaptive_avg_pool3d_backward.default, rand(1, 2, 2, 3, 3, seed=1), x)


# --- padding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("pad", [[1, 2], [1, 0, 2, 3], [0, 0, 1, 1, 2, 0], [-1, 2, 1, -2]])
@pytest.mark.parametrize("value", [0, 1.5])
def test_constant_pad_nd(pad, value):
    assert_lowering_matches(aten.constant_pad_nd.default, rand(2, 3, 4, 5), pad, value, atol=0, rtol=0)


def test_constant_pad_nd_integer_and_traced_value():
    x = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    assert_lowering_matches(aten.constant_pad_nd.default, x, [1, 1], 7, atol=0, rtol=0)
    got = conv_lowerings.constant_pad_nd(to_jax(rand(2, 3)), [1, 0], jnp.float32(-2.5))
    torch.testing.assert_close(to_torch(got, torch.float32), aten.constant_pad_nd(rand(2, 3), [1, 0], -2.5))


@pytest.mark.parametrize("kind", ["reflection", "replication"])
@pytest.mark.parametrize("spatial,padding", [(1, [2, 1]), (2, [1, 2, 0, 3]), (3, [1, 0, 2, 1, 1, 1])])
@pytest.mark.parametrize("batched", [True, False])
def test_edge_padding_forward_and_backward(kind, spatial, padding, batched):
    shape = ((2,) if batched else ()) + (3,) + (5, 4, 4)[:spatial]
    x = rand(*shape)
    forward = getattr(aten, f"{kind}_pad{spatial}d").default
    backward = getattr(aten, f"{kind}_pad{spatial}d_backward").default
    assert_lowering_matches(forward, x, padding, atol=0, rtol=0)
    out = forward(x, padding)
    assert_lowering_matches(backward, rand(*out.shape, seed=1), x, padding)


# --- upsampling ------------------------------------------------------------------------------


@pytest.mark.parametrize("in_hw,output_size,scales", [
    ((4, 5), [8, 10], None), ((6, 6), [4, 7], None), ((4, 5), None, [1.5, 2.7]), ((5, 3), None, [0.5, 2.0])])
def test_upsample_nearest2d(in_hw, output_size, scales):
    x = rand(2, 3, *in_hw)
    assert_lowering_matches(aten.upsample_nearest2d.vec, x, output_size, scales, atol=0, rtol=0)
    out = aten.upsample_nearest2d.vec(x, output_size, scales)
    scale_args = scales or [None, None]
    assert_lowering_matches(aten.upsample_nearest2d_backward.default, rand(*out.shape, seed=1),
                            list(out.shape[-2:]), list(x.shape), *scale_args)


def test_upsample_nearest_1d_3d_and_default_overload():
    assert_lowering_matches(aten.upsample_nearest1d.vec, rand(2, 3, 5), [12], None, atol=0, rtol=0)
    assert_lowering_matches(aten.upsample_nearest3d.vec, rand(1, 2, 3, 4, 2), None, [2.0, 1.5, 3.0],
                            atol=0, rtol=0)
    assert_lowering_matches(aten.upsample_nearest2d.default, rand(1, 2, 3, 4), [7, 9], 2.5, 2.1, atol=0, rtol=0)


@pytest.mark.parametrize("in_hw,output_size,scales,align_corners", [
    ((4, 5), [8, 10], None, False), ((4, 5), [7, 3], None, True), ((6, 6), [1, 4], None, True),
    ((6, 6), [1, 4], None, False), ((4, 5), None, [1.5, 2.7], False), ((4, 5), None, [1.5, 2.7], True)])
def test_upsample_bilinear2d(in_hw, output_size, scales, align_corners):
    x = rand(2, 3, *in_hw)
    assert_lowering_matches(aten.upsample_bilinear2d.vec, x, output_size, align_corners, scales)
    out = aten.upsample_bilinear2d.vec(x, output_size, align_corners, scales)
    scale_args = scales or [None, None]
    assert_lowering_matches(aten.upsample_bilinear2d_backward.default, rand(*out.shape, seed=1),
                            list(out.shape[-2:]), list(x.shape), align_corners, *scale_args)


def test_upsample_linear_1d_3d_bf16_and_traced_scales():
    assert_lowering_matches(aten.upsample_linear1d.vec, rand(2, 3, 5), [9], False, None)
    assert_lowering_matches(aten.upsample_trilinear3d.vec, rand(1, 2, 3, 4, 2), None, True, [2.0, 1.5, 3.0])
    assert_lowering_matches(aten.upsample_bilinear2d.vec, rand(1, 2, 4, 4).bfloat16(), [8, 6], False, None,
                            **tolerance(torch.bfloat16, 4))  # 2 x 2 interpolation weights
    # Scales arriving as JAX scalars (a float argument may be traced) give the same result.
    x = rand(1, 2, 4, 5)
    expected = aten.upsample_bilinear2d(x, [7, 11], False, 1.7, 2.3)
    got = conv_lowerings.upsample_bilinear2d(to_jax(x), [7, 11], False, jnp.float32(1.7), jnp.float32(2.3))
    torch.testing.assert_close(to_torch(got, torch.float32), expected)
    expected = aten.upsample_nearest2d(x, [7, 11], 1.7, 2.3)
    got = conv_lowerings.upsample_nearest2d(to_jax(x), [7, 11], jnp.float32(1.7), jnp.float32(2.3))
    torch.testing.assert_close(to_torch(got, torch.float32), expected)


def test_replication_pad_negative():
    x = torch.randn(1, 2, 5, 6, generator=torch.Generator().manual_seed(0))
    assert_lowering_matches(aten.replication_pad2d.default, x, [-1, 2, 1, -2], atol=0, rtol=0)
