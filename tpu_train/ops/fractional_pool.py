"""Fractional max pooling (``fractional_max_pool2d/3d`` and their backward).

Each (batch, channel) plane draws its own pooling windows from ``random_samples`` (one uniform
``u`` per spatial dim, in ``[0, 1)``; the functional draws them): window ``i < out - 1`` of a dim
starts at ``trunc((i + u)·α) - trunc(u·α)`` with ``α = (in - k) / (out - 1)`` computed in the
samples' dtype, the last at ``in - k``, as ATen's ``generate_intervals`` does. The windows are
gathered as ``(..., out, k)`` index grids, so the starts may be traced values. The 2-d op reads
``u`` for the width from ``random_samples[..., 0]`` and for the height from ``[..., 1]``; the
3-d op reads time, height, width from ``[..., 0]``, ``[..., 1]``, ``[..., 2]``.

``indices`` are flat positions in the input plane (``h·W + w``, ``(t·H + h)·W + w``), the first
maximum in row-major window order (a NaN counts as the maximum), as ATen's loops keep it.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from tpu_train.ops.registry import aten, lowers


def _windows(u, size, out, k):
    """``(..., out, k)`` input positions of each window along one dim."""
    alpha = (jnp.asarray(size - k, u.dtype) / max(out - 1, 1)).astype(u.dtype)
    i = jnp.arange(out, dtype=u.dtype)
    starts = jnp.trunc((i + u[..., None]) * alpha) - jnp.trunc(u[..., None] * alpha)
    starts = starts.astype(jnp.int32)
    starts = jnp.where(jnp.arange(out) == out - 1, size - k, starts)
    return starts[..., :, None] + jnp.arange(k)


def _pool(x, kernel, output_size, samples, order):
    """Max and flat argmax over fractional windows; ``order[d]`` is the sample column of dim d."""
    unbatched = x.ndim == len(kernel) + 1
    if unbatched:
        x = x[None]
    spatial = x.shape[2:]
    dims = len(kernel)
    plane = x.reshape(x.shape[:2] + (-1,))
    flat = jnp.zeros((), jnp.int32)
    for d in range(dims):
        pos = _windows(samples[..., order[d]], spatial[d], output_size[d], kernel[d])
        # pos: (N, C, out_d, k_d) -> place out_d and k_d on their own axes of the final grid
        # (N, C, out_0, ..., out_{D-1}, k_0, ..., k_{D-1}).
        shape = [pos.shape[0], pos.shape[1]] + [1] * (2 * dims)
        shape[2 + d], shape[2 + dims + d] = output_size[d], kernel[d]
        flat = flat * spatial[d] + pos.reshape(shape)
    grid = flat.shape[:2] + tuple(output_size) + tuple(kernel)
    flat = jnp.broadcast_to(flat, grid).reshape(grid[:2] + (-1,))
    values = jnp.take_along_axis(plane, flat, axis=2).reshape(grid[:2 + dims] + (-1,))
    choice = jnp.argmax(jnp.where(jnp.isnan(values), jnp.inf, values), axis=-1)
    first_nan = jnp.argmax(jnp.isnan(values), axis=-1)
    choice = jnp.where(jnp.any(jnp.isnan(values), axis=-1), first_nan, choice)
    out = jnp.take_along_axis(values, choice[..., None], axis=-1)[..., 0]
    indices = jnp.take_along_axis(flat.reshape(values.shape), choice[..., None], axis=-1)[..., 0]
    if unbatched:
        out, indices = out[0], indices[0]
    return out, indices


def _unpool(grad_output, x, indices, dims):
    """Scatter-add ``grad_output`` to the flat input-plane positions in ``indices``."""
    planes = math.prod(x.shape[:x.ndim - dims])
    size = math.prod(x.shape[x.ndim - dims:])
    g = grad_output.reshape(planes, -1)
    idx = indices.reshape(planes, -1)
    out = jnp.zeros((planes, size), grad_output.dtype)
    out = out.at[jnp.arange(planes)[:, None], idx].add(g)
    return out.reshape(x.shape)


@lowers(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(self, kernel_size, output_size, random_samples):
    """Returns ``(output, indices)``."""
    return _pool(self, tuple(kernel_size), tuple(output_size), random_samples, (1, 0))


@lowers(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(self, kernel_size, output_size, random_samples):
    """Returns ``(output, indices)``."""
    return _pool(self, tuple(kernel_size), tuple(output_size), random_samples, (0, 1, 2))


@lowers(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad_output, self, kernel_size, output_size, indices):
    return _unpool(grad_output, self, indices, 2)


@lowers(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad_output, self, kernel_size, output_size, indices):
    return _unpool(grad_output, self, indices, 3)
