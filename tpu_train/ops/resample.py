"""Backward lowerings of upsampling and adaptive max pooling; bicubic and nearest-exact forward.

The upsampling backward ops are the exact pullbacks (``jax.vjp``) of the forward lowerings in
:mod:`conv`: each forward is linear in its input, so its transpose scatters the output gradient
with the forward's own weights. Bicubic (``upsample_bicubic2d``) and nearest-exact
(``_upsample_nearest_exact*``) have a JAX forward here too, following ATen's kernels:
bicubic is separable, with the cubic-convolution weights (A = -0.75) of the four neighbours at
clamped indices; nearest-exact takes source ``floor((dst + 0.5) * in / out)``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tpu_train.ops.conv import (_apply_along, _inverse_scale, _is_static, _max_pool_backward,
                                _source_coordinates,
                                _up, _upsample_linear, _upsample_nearest, _vjp_wrt_first)
from tpu_train.ops.matmul import accumulator_dtype
from tpu_train.ops.registry import aten, lowers

_CUBIC_A = -0.75


def _nearest_exact_source(in_size, out_size, scale):
    step = _inverse_scale(in_size, out_size, scale)
    xp = np if _is_static(scale) else jnp
    dst = xp.arange(out_size, dtype=np.float32)
    return xp.minimum(xp.floor((dst + np.float32(0.5)) * step).astype(np.int32), in_size - 1)


def _upsample_nearest_exact(x, output_size, scales):
    spatial = len(output_size)
    for offset, (out, scale) in enumerate(zip(output_size, scales)):
        axis = x.ndim - spatial + offset
        x = jnp.take(x, _nearest_exact_source(x.shape[axis], out, scale), axis=axis, mode="clip")
    return x


def _cubic_matrix(in_size, out_size, align_corners, scale):
    """``[out, in]`` matrix of ATen's bicubic weights along one dim (clamped borders add up)."""
    xp, src = _source_coordinates(in_size, out_size, align_corners, scale)
    base = xp.floor(src)
    t = (src - base).astype(np.float32)
    a = np.float32(_CUBIC_A)

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = (far(t + 1), near(t), near(1 - t), far(2 - t))
    cols = xp.arange(in_size)[None, :]
    matrix = 0
    for k, w in enumerate(weights):
        index = xp.clip(base.astype(np.int32) - 1 + k, 0, in_size - 1)
        matrix = matrix + (cols == index[:, None]) * w[:, None]
    return matrix.astype(np.float32)


def _upsample_bicubic(x, output_size, align_corners, scales):
    x = _up(x)
    for offset, (out, scale) in enumerate(zip(output_size, scales)):
        axis = x.ndim - 2 + offset
        x = _apply_along(x, _cubic_matrix(x.shape[axis], out, align_corners, scale), axis)
    return x


def _pullback(forward, grad_output, input_size):
    zeros = jnp.zeros(tuple(input_size), accumulator_dtype(grad_output))
    return _vjp_wrt_first(forward, zeros, grad_output)


def _scales(args, spatial):
    scales = list(args)
    return scales + [None] * (spatial - len(scales))


@lowers(aten.upsample_bicubic2d.default)
def upsample_bicubic2d(self, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_bicubic(self, list(output_size), align_corners, [scales_h, scales_w])


@lowers(aten.upsample_bicubic2d_backward.default)
def upsample_bicubic2d_backward(grad_output, output_size, input_size, align_corners,
                                scales_h=None, scales_w=None):
    return _pullback(lambda x: _upsample_bicubic(x, list(output_size), align_corners,
                                                 [scales_h, scales_w]), grad_output, input_size)


def _register_nearest(spatial):
    def nearest_backward(grad_output, output_size, input_size, *scales):
        sizes, scales = list(output_size), _scales(scales, spatial)
        return _pullback(lambda x: _upsample_nearest(x, sizes, scales), grad_output, input_size)

    def exact_forward(self, output_size, *scales):
        return _upsample_nearest_exact(self, list(output_size), _scales(scales, spatial))

    def exact_backward(grad_output, output_size, input_size, *scales):
        sizes, scales = list(output_size), _scales(scales, spatial)
        return _pullback(lambda x: _upsample_nearest_exact(x, sizes, scales), grad_output,
                         input_size)

    if spatial != 2:  # upsample_nearest2d_backward is lowered in conv
        lowers(getattr(aten, f"upsample_nearest{spatial}d_backward").default)(nearest_backward)
    lowers(getattr(aten, f"_upsample_nearest_exact{spatial}d").default)(exact_forward)
    lowers(getattr(aten, f"_upsample_nearest_exact{spatial}d_backward").default)(exact_backward)


def _register_linear(spatial, name):
    def linear_backward(grad_output, output_size, input_size, align_corners, *scales):
        sizes, scales = list(output_size), _scales(scales, spatial)
        return _pullback(lambda x: _upsample_linear(x, sizes, align_corners, scales),
                         grad_output, input_size)

    lowers(getattr(aten, f"upsample_{name}_backward").default)(linear_backward)


for _spatial in (1, 2, 3):
    _register_nearest(_spatial)
_register_linear(1, "linear1d")
_register_linear(3, "trilinear3d")


def _adaptive_window_mask(in_size, out_size):
    """``[out, in]`` bool matrix of torch's adaptive windows
    ``[floor(i * in / out), ceil((i + 1) * in / out))``."""
    i = np.arange(out_size)
    start = (i * in_size) // out_size
    end = -((-(i + 1) * in_size) // out_size)
    cols = np.arange(in_size)[None, :]
    return (cols >= start[:, None]) & (cols < end[:, None])


def _adaptive_max_pool(x, output_size):
    """Max and flat in-plane index of the first maximum (a NaN wins) of each adaptive window."""
    spatial = len(output_size)
    in_sizes = x.shape[-spatial:]
    mask = np.ones(tuple(output_size) + tuple(in_sizes), bool)
    for d, (in_size, out_size) in enumerate(zip(in_sizes, output_size)):
        shape = [1] * (2 * spatial)
        shape[d], shape[spatial + d] = out_size, in_size
        mask = mask & _adaptive_window_mask(in_size, out_size).reshape(shape)
    # mask: [out_1..out_s, in_1..in_s] -> [out..., plane]
    mask = mask.reshape(tuple(output_size) + (-1,))
    flat = x.reshape(x.shape[:-spatial] + (1,) * spatial + (-1,))
    lowest = jnp.array(-jnp.inf, x.dtype)
    values = jnp.where(mask, jnp.where(jnp.isnan(flat), jnp.nan, flat), lowest)
    key = jnp.where(mask & jnp.isnan(flat), jnp.inf, values)
    index = jnp.argmax(key, axis=-1).astype(jnp.int32)
    return jnp.take_along_axis(values, index[..., None], axis=-1)[..., 0], index


@lowers(aten.adaptive_max_pool2d.default)
def adaptive_max_pool2d(self, output_size):
    return _adaptive_max_pool(self, list(output_size))


@lowers(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _max_pool_backward(grad_output, self, 2, indices)


@lowers(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return _max_pool_backward(grad_output, self, 3, indices)
