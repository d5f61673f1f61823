"""``_upsample_bilinear2d_aa`` (antialiased bilinear resize) and its backward.

Separable: each output row/column is a normalized triangle-filter average of the input ones,
the filter widened by the scale when downsampling (PIL's antialias, ATen's
``_compute_indices_min_size_weights_aa``). For output index ``i``: ``center = scale·(i + ½)``,
``support = scale`` (downsampling) or 1; taps ``j`` from ``trunc(center - support + ½)`` to
``trunc(center + support + ½)`` (clamped to the input) weigh ``max(0, 1 - |(j - center + ½) /
max(scale, 1)|)``, divided by their sum. ``scale`` is ``area_pixel_compute_scale``'s:
``(in - 1)/(out - 1)`` with ``align_corners``, else ``1/scales`` when given, else ``in/out``.

The weights depend only on sizes and scales, so they are built with NumPy as constant
``(out, in)`` matrices and applied with two contractions; the backward applies their
transposes. The scales are read as Python values (``static_floats``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import numpy as np

from tpu_train.ops.conversion import opmath_dtype
from tpu_train.ops.registry import aten, lowers

# A filter, not a user matmul: full float32 passes whatever torch's matmul precision says.
_EXACT = lax.Precision.HIGHEST


def _scale(in_size, out_size, align_corners, scale):
    if align_corners:
        return (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    if scale is not None and scale > 0:
        return 1.0 / scale
    return in_size / out_size


def _weights(in_size, out_size, align_corners, scale):
    """The ``(out_size, in_size)`` resampling matrix of one dim."""
    scale = np.float32(_scale(in_size, out_size, align_corners, scale))
    support = scale if scale >= 1 else np.float32(1.0)
    invscale = 1 / scale if scale >= 1 else np.float32(1.0)
    matrix = np.zeros((out_size, in_size), np.float64)
    for i in range(out_size):
        center = scale * np.float32(i + 0.5)
        low = max(int(center - support + np.float32(0.5)), 0)
        high = min(int(center + support + np.float32(0.5)), in_size)
        taps = np.arange(low, high)
        w = np.maximum(0, 1 - np.abs((taps - center + np.float32(0.5)) * invscale))
        total = w.sum()
        matrix[i, low:high] = w / total if total != 0 else w
    return matrix


def _matrices(in_hw, out_hw, align_corners, scales_h, scales_w, dtype):
    return (jnp.asarray(_weights(in_hw[0], out_hw[0], align_corners, scales_h), dtype),
            jnp.asarray(_weights(in_hw[1], out_hw[1], align_corners, scales_w), dtype))


@lowers(aten._upsample_bilinear2d_aa.default, static_floats=True)
def upsample_bilinear2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    """``(N, C, H, W)`` → ``(N, C, *output_size)``."""
    compute = opmath_dtype(self.dtype)
    wh, ww = _matrices(self.shape[-2:], tuple(output_size), align_corners, scales_h, scales_w,
                       compute)
    out = jnp.einsum("oh,nchw,pw->ncop", wh, self.astype(compute), ww, precision=_EXACT)
    return out.astype(self.dtype)


@lowers(aten._upsample_bilinear2d_aa_backward.default, static_floats=True)
def upsample_bilinear2d_aa_backward(grad_output, output_size, input_size, align_corners,
                                    scales_h=None, scales_w=None):
    """The input gradient ``(N, C, H, W)``: the transposed resampling."""
    compute = opmath_dtype(grad_output.dtype)
    wh, ww = _matrices(tuple(input_size[-2:]), tuple(output_size), align_corners, scales_h,
                       scales_w, compute)
    grad = jnp.einsum("oh,ncop,pw->nchw", wh, grad_output.astype(compute), ww, precision=_EXACT)
    return grad.astype(grad_output.dtype)
