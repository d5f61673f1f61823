"""``grid_sampler_3d`` (trilinear or nearest) and its backward.

``grid[..., (0, 1, 2)]`` holds normalized ``(x, y, z)`` in ``[-1, 1]`` for the input's
``(W, H, D)``; a coordinate is unnormalized to pixel units (``align_corners``: -1 and 1 are the
corner voxels' centres, else the corners' outer edges), then the padding mode applies: zeros
(out-of-range voxels read 0), border (clamped into the volume), reflection (mirrored at the
same edges, then clamped), as ATen's ``compute_coordinates`` does. Nearest rounds half to even
(``nearbyint``). The backward is the pullback of this forward for both the input and the grid.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpu_train.ops.conversion import opmath_dtype
from tpu_train.ops.registry import aten, lowers

_BILINEAR, _NEAREST = 0, 1
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def _reflect(x, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(x)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    x = x - low
    x = jnp.where(x < 0, -x, x)  # ATen's sign rule: slope +1 at 0 (jnp.abs has 0 there)
    extra = jnp.fmod(x, span)
    flips = jnp.floor(x / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _unnormalize(coord, size, align_corners):
    """A normalized coordinate in pixel units (ATen's ``grid_sampler_unnormalize``)."""
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _source(coord, size, padding_mode, align_corners):
    return _pad(_unnormalize(coord, size, align_corners), size, padding_mode, align_corners)


def _clip(x, size):
    """``x`` clipped into ``[0, size - 1]`` with ATen's slope 0 at either bound (jnp.clip's is
    1/2 there: a grid point exactly on a border gets another gradient)."""
    return jnp.where(x <= 0, 0.0, jnp.where(x >= size - 1, size - 1.0, x))


def _pad(x, size, padding_mode, align_corners):
    """A pixel-unit coordinate moved by the padding mode (ATen's ``compute_coordinates``)."""
    if padding_mode == _BORDER:
        x = _clip(x, size)
    elif padding_mode == _REFLECTION:
        if align_corners:
            x = _reflect(x, 0, 2 * (size - 1))
        else:
            x = _reflect(x, -1, 2 * size - 1)
        x = _clip(x, size)
    return x


def _gather(volume, sizes, corner):
    """``volume`` ``(N, C, D·H·W)`` at integer ``corner = (z, y, x)`` ``(N, P)`` each; 0
    outside the volume."""
    (d, h, w), (z, y, x) = sizes, corner
    inside = (z >= 0) & (z < d) & (y >= 0) & (y < h) & (x >= 0) & (x < w)
    flat = (jnp.clip(z, 0, d - 1) * h + jnp.clip(y, 0, h - 1)) * w + jnp.clip(x, 0, w - 1)
    values = jnp.take_along_axis(volume, flat[:, None, :], axis=2)
    return jnp.where(inside[:, None, :], values, 0)


def _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners):
    n, c, d, h, w = input.shape
    out_spatial = grid.shape[1:4]
    compute = opmath_dtype(input.dtype)
    volume = input.astype(compute).reshape(n, c, -1)
    g = grid.astype(compute).reshape(n, -1, 3)
    coords = [_source(g[..., axis], size, padding_mode, align_corners)
              for axis, size in ((2, d), (1, h), (0, w))]  # z, y, x
    if interpolation_mode == _NEAREST:
        corner = [jnp.round(x).astype(jnp.int32) for x in coords]
        out = _gather(volume, (d, h, w), corner)
    elif interpolation_mode == _BILINEAR:
        low = [jnp.floor(x) for x in coords]
        frac = [x - lo for x, lo in zip(coords, low)]
        low = [lo.astype(jnp.int32) for lo in low]
        out = jnp.zeros((n, c, g.shape[1]), compute)
        for dz in (0, 1):
            for dy in (0, 1):
                for dx in (0, 1):
                    weight = 1.0
                    for step, f in zip((dz, dy, dx), frac):
                        weight = weight * (f if step else 1 - f)
                    corner = [lo + step for lo, step in zip(low, (dz, dy, dx))]
                    out = out + weight[:, None, :] * _gather(volume, (d, h, w), corner)
    else:
        raise NotImplementedError("grid_sampler_3d: bicubic interpolation needs a 2-d input")
    return out.reshape((n, c) + out_spatial).astype(input.dtype)


@lowers(aten.grid_sampler_3d.default)
def grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    """``(N, C, D, H, W)`` sampled at ``grid`` ``(N, D', H', W', 3)`` → ``(N, C, D', H', W')``."""
    return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)


@lowers(aten.grid_sampler_3d_backward.default)
def grid_sampler_3d_backward(grad_output, input, grid, interpolation_mode, padding_mode,
                             align_corners, output_mask):
    """``(grad_input, grad_grid)`` (``grad_input`` zeros unless ``output_mask[0]``)."""
    return sampler_pullback(_grid_sample, grad_output, input, grid, interpolation_mode,
                            padding_mode, align_corners, output_mask)


def sampler_pullback(sample, grad_output, input, grid, interpolation_mode, padding_mode,
                     align_corners, output_mask):
    """A grid sampler's backward: the pullback of ``sample`` for the input and the grid."""
    _, pullback = jax.vjp(
        lambda i, g: sample(i, g, interpolation_mode, padding_mode, align_corners), input, grid)
    grad_input, grad_grid = pullback(grad_output.astype(input.dtype))
    if not output_mask[0]:
        grad_input = jnp.zeros_like(input)
    return grad_input, grad_grid
