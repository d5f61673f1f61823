"""Lowerings of convolution, pooling, padding and upsampling.

Spatial dims are the trailing ones (``N, C, *spatial`` or unbatched ``C, *spatial``), so most
helpers are written once for any number of spatial dims and registered for the 1-D/2-D/3-D ops.
Backward ops of linear maps (average pooling, upsampling, padding, convolution) are the VJP of
the forward lowering: exact, and XLA turns them into the same windowed ops a hand-written
transpose would use.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpu_train.ops.matmul import accumulator_dtype, lax_precision
from tpu_train.ops.registry import aten, lowers


def _per_dim(values, ndim):
    """torch lets ``int[N]`` arguments be given as one value for every spatial dim."""
    values = list(values)
    return values * ndim if len(values) == 1 else values


def _up(x):
    return x.astype(accumulator_dtype(x))


def _vjp_wrt_first(forward, primal, cotangent):
    """Gradient of the linear-in-``primal`` map ``forward`` at ``primal`` for ``cotangent``."""
    out, pullback = jax.vjp(forward, primal)
    (grad,) = pullback(cotangent.astype(out.dtype))
    return grad


# --- convolution -----------------------------------------------------------------------------


def _transposed_conv_weight(weight, groups):
    """Turn a transposed conv's ``[C_in, C_out/g, *k]`` weight into a forward conv's ``[C_out, C_in/g, *k]``."""
    c_in, c_out_per_group = weight.shape[:2]
    kernel = weight.shape[2:]
    w = weight.reshape((groups, c_in // groups, c_out_per_group) + kernel)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * c_out_per_group, c_in // groups) + kernel)
    return jnp.flip(w, axis=tuple(range(2, w.ndim)))


def _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups):
    spatial = weight.ndim - 2
    stride, padding, dilation = (_per_dim(v, spatial) for v in (stride, padding, dilation))
    letters = "DHW"[-spatial:] if spatial <= 3 else None
    dims = ("NC" + letters, "OI" + letters, "NC" + letters)
    dtype = jnp.result_type(input, weight)
    input, weight = input.astype(dtype), weight.astype(dtype)
    if transposed:
        output_padding = _per_dim(output_padding, spatial)
        kernel = weight.shape[2:]
        weight = _transposed_conv_weight(weight, groups)
        # A transposed conv is a conv over the stride-dilated input, padded so that every
        # kernel tap that touched an input element in the forward conv sees it again.
        pads = [(d * (k - 1) - p, d * (k - 1) - p + op)
                for k, p, d, op in zip(kernel, padding, dilation, output_padding)]
        return lax.conv_general_dilated(
            input, weight, window_strides=(1,) * spatial, padding=pads, lhs_dilation=stride,
            rhs_dilation=dilation, dimension_numbers=dims, feature_group_count=groups,
            precision=lax_precision(), preferred_element_type=accumulator_dtype(input))
    return lax.conv_general_dilated(
        input, weight, window_strides=stride, padding=[(p, p) for p in padding],
        rhs_dilation=dilation, dimension_numbers=dims, feature_group_count=groups,
        precision=lax_precision(), preferred_element_type=accumulator_dtype(input))


@lowers(aten.convolution.default)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    out = _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + bias.astype(out.dtype).reshape((1, -1) + (1,) * (out.ndim - 2))
    return out


@lowers(aten.convolution_backward.default)
def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    def forward(x, w):
        return _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)

    grad_input = grad_weight = grad_bias = None
    if output_mask[0] or output_mask[1]:
        out, pullback = jax.vjp(forward, input, weight)
        grad_input, grad_weight = pullback(grad_output.astype(out.dtype))
    if output_mask[2]:
        grad_bias = jnp.sum(_up(grad_output), axis=(0,) + tuple(range(2, grad_output.ndim)))
    return (grad_input if output_mask[0] else None,
            grad_weight if output_mask[1] else None,
            grad_bias)


# --- pooling ---------------------------------------------------------------------------------


def _pool_geometry(in_sizes, kernel, stride, padding, dilation, ceil_mode):
    """Output sizes and the extra high-side padding that ``ceil_mode`` windows need."""
    out_sizes, high = [], []
    for size, k, s, p, d in zip(in_sizes, kernel, stride, padding, dilation):
        span = size + 2 * p - d * (k - 1) - 1
        out = (-(-span // s) if ceil_mode else span // s) + 1
        # torch drops a last window that would start entirely in the right padding.
        if ceil_mode and (out - 1) * s >= size + p:
            out -= 1
        out_sizes.append(out)
        high.append(max((out - 1) * s + d * (k - 1) + 1 - size - p, 0))
    return out_sizes, high


def _pool_args(x, spatial, kernel_size, stride, padding, dilation=(1,)):
    kernel = _per_dim(kernel_size, spatial)
    stride = _per_dim(stride, spatial) if len(stride) else kernel
    return kernel, stride, _per_dim(padding, spatial), _per_dim(dilation, spatial)


def _window(spatial, x, values):
    return (1,) * (x.ndim - spatial) + tuple(values)


def _max_with_first_index(a, b):
    """Combine (value, index) pairs the way torch scans a window: NaN wins (the last NaN),
    otherwise the larger value, and among equal values the first (smallest) index."""
    va, ia = a
    vb, ib = b
    a_nan, b_nan = jnp.isnan(va), jnp.isnan(vb)
    take_b = jnp.where(a_nan | b_nan,
                       b_nan & (~a_nan | (ib > ia)),
                       (vb > va) | ((vb == va) & (ib < ia)))
    return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)


def _max_pool_with_indices(self, spatial, kernel_size, stride, padding, dilation, ceil_mode):
    kernel, stride, padding, dilation = _pool_args(self, spatial, kernel_size, stride, padding, dilation)
    geometry = tuple(tuple(int(v) for v in values) for values in (kernel, stride, padding, dilation))
    return _max_pool_selecting(self, spatial, geometry, bool(ceil_mode))


# The pair (max, index of the first max) is a variadic ``reduce_window``, which JAX cannot
# differentiate; differentiated (a compiled step's loss graph), the gradient goes to each
# window's recorded index, as ``max_pool*_with_indices_backward`` routes it in PyTorch.
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _max_pool_selecting(self, spatial, geometry, ceil_mode):
    kernel, stride, padding, dilation = geometry
    in_sizes = self.shape[-spatial:]
    _, high = _pool_geometry(in_sizes, kernel, stride, padding, dilation, ceil_mode)
    plane = np.arange(int(np.prod(in_sizes)), dtype=np.int32).reshape(in_sizes)
    index = jnp.broadcast_to(jnp.asarray(plane), self.shape)
    pads = [(0, 0)] * (self.ndim - spatial) + list(zip(padding, high))
    lowest = -jnp.inf if jnp.issubdtype(self.dtype, jnp.floating) else jnp.iinfo(self.dtype).min
    # Padding carries an index larger than any real one, so a real element always wins a tie.
    out, indices = lax.reduce_window(
        (self, index), (jnp.array(lowest, self.dtype), jnp.array(np.iinfo(np.int32).max, jnp.int32)),
        _max_with_first_index, _window(spatial, self, kernel), _window(spatial, self, stride), pads,
        window_dilation=_window(spatial, self, dilation))
    return out, indices


def _max_pool_selecting_forward(self, spatial, geometry, ceil_mode):
    out, indices = _max_pool_selecting(self, spatial, geometry, ceil_mode)
    return (out, indices), (self, indices)


def _max_pool_selecting_backward(spatial, geometry, ceil_mode, saved, cotangents):
    self, indices = saved
    return (_max_pool_backward(cotangents[0], self, spatial, indices).astype(self.dtype),)


_max_pool_selecting.defvjp(_max_pool_selecting_forward, _max_pool_selecting_backward)


def _max_pool_backward(grad_output, self, spatial, indices):
    lead = self.shape[:-spatial]
    plane = int(np.prod(self.shape[-spatial:]))
    g = _up(grad_output).reshape(-1, int(np.prod(grad_output.shape[-spatial:])))
    idx = indices.reshape(g.shape)
    rows = lax.broadcasted_iota(jnp.int32, g.shape, 0)
    grad = jnp.zeros((g.shape[0], plane), g.dtype).at[rows, idx].add(g, mode="drop")
    return grad.reshape(lead + self.shape[-spatial:])


@lowers(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    return _max_pool_with_indices(self, 2, kernel_size, stride, padding, dilation, ceil_mode)


@lowers(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    return _max_pool_with_indices(self, 3, kernel_size, stride, padding, dilation, ceil_mode)


@lowers(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode,
                                     indices):
    return _max_pool_backward(grad_output, self, 2, indices)


@lowers(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode,
                                     indices):
    return _max_pool_backward(grad_output, self, 3, indices)


def _avg_pool_divisor(in_sizes, out_sizes, kernel, stride, padding, count_include_pad):
    """Per-output-position divisor (static), following torch's clipping of each window."""
    per_dim = []
    for size, out, k, s, p in zip(in_sizes, out_sizes, kernel, stride, padding):
        start = np.arange(out) * s - p
        end = np.minimum(start + k, size + p)
        if count_include_pad:
            per_dim.append(end - start)
        else:
            per_dim.append(np.minimum(end, size) - np.maximum(start, 0))
    divisor = per_dim[0]
    for extra in per_dim[1:]:
        divisor = np.multiply.outer(divisor, extra)
    return divisor.astype(np.float32)


def _avg_pool(self, spatial, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    kernel, stride, padding, _ = _pool_args(self, spatial, kernel_size, stride, padding)
    in_sizes = self.shape[-spatial:]
    out_sizes, high = _pool_geometry(in_sizes, kernel, stride, padding, [1] * spatial, ceil_mode)
    x = _up(self)
    pads = [(0, 0)] * (self.ndim - spatial) + list(zip(padding, high))
    # A numpy init value stays concrete under jit, so JAX sees the (add, 0) monoid and uses
    # the differentiable windowed-sum primitive (a traced init has no reverse-mode rule).
    total = lax.reduce_window(x, np.array(0, x.dtype), lax.add, _window(spatial, x, kernel),
                              _window(spatial, x, stride), pads)
    if divisor_override:
        return total / divisor_override
    return total / _avg_pool_divisor(in_sizes, out_sizes, kernel, stride, padding, count_include_pad)


@lowers(aten.avg_pool2d.default)
def avg_pool2d(self, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(self, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lowers(aten.avg_pool3d.default)
def avg_pool3d(self, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(self, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lowers(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):
    return _vjp_wrt_first(lambda x: _avg_pool(x, 2, kernel_size, stride, padding, ceil_mode,
                                              count_include_pad, divisor_override), _up(self), grad_output)


@lowers(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):
    return _vjp_wrt_first(lambda x: _avg_pool(x, 3, kernel_size, stride, padding, ceil_mode,
                                              count_include_pad, divisor_override), _up(self), grad_output)


def _adaptive_average_matrix(in_size, out_size):
    """``[out, in]`` matrix averaging torch's adaptive window ``[floor(i*in/out), ceil((i+1)*in/out))``."""
    i = np.arange(out_size)
    start = (i * in_size) // out_size
    end = -((-(i + 1) * in_size) // out_size)
    cols = np.arange(in_size)
    inside = (cols[None, :] >= start[:, None]) & (cols[None, :] < end[:, None])
    return (inside / (end - start)[:, None]).astype(np.float32)


def _apply_along(x, matrix, axis):
    """Contract ``x``'s ``axis`` with the ``[out, in]`` ``matrix``, keeping the axis in place."""
    out = lax.dot_general(x, jnp.asarray(matrix, x.dtype), (((axis,), (1,)), ((), ())),
                          precision=lax.Precision.HIGHEST)
    return jnp.moveaxis(out, -1, axis)


def _adaptive_avg_pool(self, output_size):
    spatial = len(output_size)
    x = _up(self)
    in_sizes = x.shape[-spatial:]
    if all(i % o == 0 for i, o in zip(in_sizes, output_size)):
        # Equal, non-overlapping windows: a reshape and a mean.
        split = x.shape[:-spatial]
        for i, o in zip(in_sizes, output_size):
            split += (o, i // o)
        axes = tuple(range(x.ndim - spatial + 1, x.ndim + spatial, 2))
        return jnp.mean(x.reshape(split), axis=axes)
    for offset, (i, o) in enumerate(zip(in_sizes, output_size)):
        x = _apply_along(x, _adaptive_average_matrix(i, o), x.ndim - spatial + offset)
    return x


@lowers(aten._adaptive_avg_pool2d.default)
def adaptive_avg_pool2d(self, output_size):
    return _adaptive_avg_pool(self, list(output_size))


@lowers(aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool3d(self, output_size):
    return _adaptive_avg_pool(self, list(output_size))


@lowers(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(grad_output, self):
    output_size = list(grad_output.shape[-2:])
    return _vjp_wrt_first(lambda x: _adaptive_avg_pool(x, output_size), _up(self), grad_output)


@lowers(aten._adaptive_avg_pool3d_backward.default)
def adaptive_avg_pool3d_backward(grad_output, self):
    output_size = list(grad_output.shape[-3:])
    return _vjp_wrt_first(lambda x: _adaptive_avg_pool(x, output_size), _up(self), grad_output)


# --- padding ---------------------------------------------------------------------------------


@lowers(aten.constant_pad_nd.default)
def constant_pad_nd(self, pad, value=0):
    # ``pad`` lists (low, high) pairs starting from the last dim; negative entries crop.
    config = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        config[self.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(self, jnp.asarray(value, self.dtype), config)


def _edge_pad(self, padding, mode):
    spatial = len(padding) // 2
    widths = [(0, 0)] * (self.ndim - spatial)
    for i in reversed(range(spatial)):
        widths.append((padding[2 * i], padding[2 * i + 1]))
    if mode == "edge" and any(w < 0 for pair in widths for w in pair):
        # Negative replication padding crops: out[j] = in[clamp(j - low, 0, n - 1)].
        for axis, (low, high) in enumerate(widths):
            n = self.shape[axis]
            if (low, high) != (0, 0):
                source = np.clip(np.arange(n + low + high) - low, 0, n - 1)
                self = jnp.take(self, source, axis=axis)
        return self
    return jnp.pad(self, widths, mode=mode)


def _register_edge_pads():
    for spatial in (1, 2, 3):
        for name, mode in (("reflection", "reflect"), ("replication", "edge")):
            forward_op = getattr(aten, f"{name}_pad{spatial}d").default
            backward_op = getattr(aten, f"{name}_pad{spatial}d_backward").default

            def forward(self, padding, _mode=mode):
                return _edge_pad(self, padding, _mode)

            def backward(grad_output, self, padding, _mode=mode):
                return _vjp_wrt_first(lambda x: _edge_pad(x, padding, _mode), _up(self), grad_output)

            forward.__name__ = f"{name}_pad{spatial}d"
            backward.__name__ = f"{name}_pad{spatial}d_backward"
            lowers(forward_op)(forward)
            lowers(backward_op)(backward)


_register_edge_pads()


# --- upsampling ------------------------------------------------------------------------------


def _is_static(value):
    return value is None or isinstance(value, (int, float))


def _inverse_scale(in_size, out_size, scale):
    """torch's source-per-destination step: ``1/scale`` when a positive scale is given, else in/out."""
    if scale is None:
        return np.float32(in_size / out_size)
    if _is_static(scale):
        return np.float32(1.0 / scale) if scale > 0 else np.float32(in_size / out_size)
    return jnp.where(scale > 0, 1.0 / scale, in_size / out_size).astype(jnp.float32)


def _nearest_source(in_size, out_size, scale):
    step = _inverse_scale(in_size, out_size, scale)
    xp = np if _is_static(scale) else jnp
    dst = xp.arange(out_size, dtype=np.float32)
    return xp.minimum(xp.floor(dst * step).astype(np.int32), in_size - 1)


def _upsample_nearest(x, output_size, scales):
    spatial = len(output_size)
    for offset, (out, scale) in enumerate(zip(output_size, scales)):
        axis = x.ndim - spatial + offset
        in_size = x.shape[axis]
        source = _nearest_source(in_size, out, scale)
        if isinstance(source, np.ndarray) and out % in_size == 0 and np.array_equal(
                source, np.arange(out) // (out // in_size)):
            # An integer upscale: a repeat (broadcast + reshape) rather than a gather.
            x = jnp.repeat(x, out // in_size, axis=axis)
        else:
            x = jnp.take(x, source, axis=axis, mode="clip")
    return x


def _source_coordinates(in_size, out_size, align_corners, scale):
    """``(xp, src)``: the array module (numpy for static scales) and, per output position,
    the input coordinate ATen's linear and cubic interpolations read (not clamped)."""
    xp = np if _is_static(scale) else jnp
    dst = xp.arange(out_size, dtype=np.float32)
    if align_corners:
        step = np.float32((in_size - 1) / (out_size - 1)) if out_size > 1 else np.float32(0)
        return xp, dst * step
    return xp, (dst + np.float32(0.5)) * _inverse_scale(in_size, out_size, scale) - np.float32(0.5)


def _linear_interpolation_matrix(in_size, out_size, align_corners, scale):
    """``[out, in]`` matrix of torch's (bi/tri)linear weights along one dim."""
    xp, src = _source_coordinates(in_size, out_size, align_corners, scale)
    if not align_corners:
        src = xp.maximum(src, 0)
    low = xp.floor(src).astype(np.int32)
    high = xp.where(low < in_size - 1, low + 1, low)
    frac = xp.clip(src - low, 0, 1).astype(np.float32)
    cols = xp.arange(in_size)[None, :]
    return ((cols == low[:, None]) * (1 - frac)[:, None] + (cols == high[:, None]) * frac[:, None]).astype(
        np.float32)


def _upsample_linear(x, output_size, align_corners, scales):
    spatial = len(output_size)
    x = _up(x)
    for offset, (out, scale) in enumerate(zip(output_size, scales)):
        axis = x.ndim - spatial + offset
        x = _apply_along(x, _linear_interpolation_matrix(x.shape[axis], out, align_corners, scale), axis)
    return x


def _vec_sizes(input, output_size, scale_factors, spatial):
    if output_size is not None:
        return list(output_size), [None] * spatial
    in_sizes = input.shape[-spatial:]
    return [int(np.floor(i * s)) for i, s in zip(in_sizes, scale_factors)], list(scale_factors)


@lowers(aten.upsample_nearest1d.default)
def upsample_nearest1d(self, output_size, scales=None):
    return _upsample_nearest(self, list(output_size), [scales])


@lowers(aten.upsample_nearest2d.default)
def upsample_nearest2d(self, output_size, scales_h=None, scales_w=None):
    return _upsample_nearest(self, list(output_size), [scales_h, scales_w])


@lowers(aten.upsample_nearest3d.default)
def upsample_nearest3d(self, output_size, scales_d=None, scales_h=None, scales_w=None):
    return _upsample_nearest(self, list(output_size), [scales_d, scales_h, scales_w])


@lowers(aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec, aten.upsample_nearest3d.vec)
def upsample_nearest_vec(input, output_size, scale_factors):
    spatial = len(output_size) if output_size is not None else len(scale_factors)
    sizes, scales = _vec_sizes(input, output_size, scale_factors, spatial)
    return _upsample_nearest(input, sizes, scales)


@lowers(aten.upsample_nearest2d_backward.default)
def upsample_nearest2d_backward(grad_output, output_size, input_size, scales_h=None, scales_w=None):
    zeros = jnp.zeros(tuple(input_size), accumulator_dtype(grad_output))
    return _vjp_wrt_first(lambda x: _upsample_nearest(x, list(output_size), [scales_h, scales_w]),
                          zeros, grad_output)


@lowers(aten.upsample_linear1d.default)
def upsample_linear1d(self, output_size, align_corners, scales=None):
    return _upsample_linear(self, list(output_size), align_corners, [scales])


@lowers(aten.upsample_bilinear2d.default)
def upsample_bilinear2d(self, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_linear(self, list(output_size), align_corners, [scales_h, scales_w])


@lowers(aten.upsample_trilinear3d.default)
def upsample_trilinear3d(self, output_size, align_corners, scales_d=None, scales_h=None, scales_w=None):
    return _upsample_linear(self, list(output_size), align_corners, [scales_d, scales_h, scales_w])


@lowers(aten.upsample_linear1d.vec, aten.upsample_bilinear2d.vec, aten.upsample_trilinear3d.vec)
def upsample_linear_vec(input, output_size, align_corners, scale_factors):
    spatial = len(output_size) if output_size is not None else len(scale_factors)
    sizes, scales = _vec_sizes(input, output_size, scale_factors, spatial)
    return _upsample_linear(input, sizes, align_corners, scales)


@lowers(aten.upsample_bilinear2d_backward.default)
def upsample_bilinear2d_backward(grad_output, output_size, input_size, align_corners, scales_h=None,
                                 scales_w=None):
    zeros = jnp.zeros(tuple(input_size), accumulator_dtype(grad_output))
    return _vjp_wrt_first(
        lambda x: _upsample_linear(x, list(output_size), align_corners, [scales_h, scales_w]),
        zeros, grad_output)
