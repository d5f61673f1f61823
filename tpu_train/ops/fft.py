"""FFT primitives behind ``torch.fft``: ``_fft_r2c``, ``_fft_c2c`` and ``_fft_c2r``.

Every ``torch.fft`` function decomposes into these three. ``normalization`` is ATen's
``fft_norm_mode``: 0 leaves the transform unscaled, 1 scales by ``1/sqrt(n)``, 2 by ``1/n``,
where ``n`` is the number of points of the signal over ``dim`` (for ``_fft_c2r`` the *output*
sizes). The scale is applied whatever the direction, so the transforms are computed unscaled
(``norm="forward"`` makes JAX's inverse transforms unscaled) and scaled here.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from tpu_train.ops.registry import aten, get_lowering, lowers


def _lowers_free(op):
    """``lowers`` unless another family already lowered ``op`` (then leave it alone)."""
    return lowers(op) if get_lowering(op) is None else (lambda fn: fn)


def _axes(dim, ndim):
    return tuple(d % ndim for d in dim)


def _scale(out, points: int, normalization: int):
    if normalization == 1:
        return out / jnp.sqrt(jnp.asarray(points, out.real.dtype))
    if normalization == 2:
        return out / jnp.asarray(points, out.real.dtype)
    return out


def _complex_dtype(dtype):
    return jnp.complex64 if jnp.dtype(dtype) != jnp.complex128 else jnp.complex128


@_lowers_free(aten._fft_r2c.default)
def fft_r2c(self, dim, normalization, onesided):
    """Real → complex forward transform over ``dim``; ``onesided`` keeps the last dim's
    ``n // 2 + 1`` non-negative frequencies."""
    axes = _axes(dim, self.ndim)
    x = self.astype(jnp.float32) if self.dtype != jnp.float32 else self
    out = jnp.fft.rfftn(x, axes=axes) if onesided else jnp.fft.fftn(x, axes=axes)
    points = math.prod(self.shape[a] for a in axes)
    return _scale(out, points, normalization).astype(jnp.complex64)


@_lowers_free(aten._fft_c2c.default)
def fft_c2c(self, dim, normalization, forward):
    """Complex → complex transform over ``dim`` (``forward=False``: the unscaled inverse)."""
    axes = _axes(dim, self.ndim)
    x = self.astype(_complex_dtype(self.dtype))
    if not axes:
        return x
    out = jnp.fft.fftn(x, axes=axes) if forward else jnp.fft.ifftn(x, axes=axes, norm="forward")
    points = math.prod(self.shape[a] for a in axes)
    return _scale(out, points, normalization)


@_lowers_free(aten._fft_c2r.default)
def fft_c2r(self, dim, normalization, last_dim_size):
    """Onesided complex → real inverse transform over ``dim``; the last dim of ``dim`` becomes
    ``last_dim_size`` points (the input's last dim holds ``last_dim_size // 2 + 1`` or more)."""
    axes = _axes(dim, self.ndim)
    sizes = [self.shape[a] for a in axes[:-1]] + [int(last_dim_size)]
    x = self.astype(_complex_dtype(self.dtype))
    out = jnp.fft.irfftn(x, s=sizes, axes=axes, norm="forward")
    return _scale(out, math.prod(sizes), normalization).astype(jnp.float32)
