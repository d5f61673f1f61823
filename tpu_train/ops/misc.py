"""Assorted ops: complex construction (``complex``, ``polar``, ``angle``, ``_conj_physical``),
``frexp``, pairwise distances (``_cdist_forward``, ``_pdist_forward``) and the ``cauchy`` /
``geometric`` / ``log_normal`` samplers.

The samplers match PyTorch in distribution, shape and dtype only (see :mod:`random`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from tpu_train.ops.conversion import float_result_dtype, opmath_dtype
from tpu_train.ops.registry import aten, get_lowering, lowers


def _lowers_free(op, random=False):
    """``lowers`` unless another family already lowered ``op`` (then leave it alone)."""
    return lowers(op, random=random) if get_lowering(op) is None else (lambda fn: fn)


# ----------------------------------------------------------------------------- complex


@_lowers_free(aten.complex.default)
def complex_(real, imag):
    """``real + i·imag`` (float32 parts give complex64)."""
    return lax.complex(real.astype(jnp.float32), imag.astype(jnp.float32))


@_lowers_free(aten.polar.default)
def polar(abs, angle):  # noqa: A002  (the schema's names)
    """``abs·(cos(angle) + i·sin(angle))``."""
    abs, angle = abs.astype(jnp.float32), angle.astype(jnp.float32)
    return lax.complex(abs * jnp.cos(angle), abs * jnp.sin(angle))


@_lowers_free(aten.angle.default)
def angle(self):
    """Argument of a complex number; for reals π below zero, 0 otherwise, NaN kept."""
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        return jnp.angle(self)
    dtype = float_result_dtype(self.dtype)
    x = self.astype(opmath_dtype(dtype))
    out = jnp.where(x < 0, jnp.pi, 0.0).astype(x.dtype)
    return jnp.where(jnp.isnan(x), x, out).astype(dtype)


@_lowers_free(aten._conj_physical.default)
def conj_physical_(self):
    """Complex conjugate as a new value (identity for real tensors)."""
    return jnp.conj(self) if jnp.issubdtype(self.dtype, jnp.complexfloating) else self


@_lowers_free(aten.frexp.Tensor)
def frexp(self):
    """``self = mantissa · 2**exponent`` with ``|mantissa|`` in [0.5, 1) (0 for 0)."""
    mantissa, exponent = jnp.frexp(self)
    return mantissa, exponent.astype(jnp.int32)


# ----------------------------------------------------------------------------- distances


def _p_norm(diff, p, axis):
    """The ``p``-norm of ``diff`` over ``axis`` for a static ``p`` (0: count, inf: max)."""
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum(a != 0, axis=axis).astype(diff.dtype)
    if p == math.inf:
        return jnp.max(a, axis=axis, initial=0.0)
    if p == 1:
        return jnp.sum(a, axis=axis)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axis))
    return jnp.sum(a ** p, axis=axis) ** (1.0 / p)


@_lowers_free(aten._cdist_forward.default)
def cdist_forward(x1, x2, p, compute_mode=None):
    """``p``-norm distance between every row of ``x1`` and every row of ``x2`` (batched)."""
    lead = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    x1 = jnp.broadcast_to(x1, lead + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, lead + x2.shape[-2:])
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    return _p_norm(diff, p, axis=-1)


@_lowers_free(aten._pdist_forward.default)
def pdist_forward(self, p=2):
    """Distances between rows ``i < j`` of a 2-D input, in row-major pair order."""
    n = self.shape[0]
    i, j = jnp.triu_indices(n, k=1)
    return _p_norm(self[i] - self[j], p, axis=-1)


def _p_norm_grad(diff, dist, p):
    """d dist / d diff for ``dist = ||diff||_p`` (ATen's _cdist_backward terms): 0 where the
    distance is 0 or ``p`` is 0."""
    dist = dist[..., None]
    zero = dist == 0
    safe = jnp.where(zero, 1, dist)
    if p == 0:
        term = jnp.zeros_like(diff)
    elif p == 1:
        term = jnp.sign(diff)
    elif p == 2:
        term = diff / safe
    elif p == math.inf:
        term = jnp.sign(diff) * (jnp.abs(diff) == dist)
    else:
        term = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) / safe ** (p - 1)
    return jnp.where(zero, 0, term)


@lowers(aten._cdist_backward.default, static_floats=True)
def cdist_backward(grad, x1, x2, p, cdist):
    """Gradient of ``_cdist_forward`` with respect to ``x1``."""
    lead = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    a = jnp.broadcast_to(x1, lead + x1.shape[-2:])
    b = jnp.broadcast_to(x2, lead + x2.shape[-2:])
    diff = a[..., :, None, :] - b[..., None, :, :]
    out = jnp.sum(_p_norm_grad(diff, cdist, p) * grad[..., None], axis=-2)
    extra = out.ndim - x1.ndim
    out = jnp.sum(out, axis=tuple(range(extra))) if extra else out
    keep = tuple(i for i, n in enumerate(x1.shape[:-2]) if n == 1 and out.shape[i] != 1)
    return jnp.sum(out, axis=keep, keepdims=True) if keep else out


@lowers(aten._pdist_backward.default, static_floats=True)
def pdist_backward(grad, self, p, pdist):
    """Gradient of ``_pdist_forward``: each pair ``i < j`` adds its term to row i and
    subtracts it from row j."""
    i, j = jnp.triu_indices(self.shape[0], k=1)
    term = _p_norm_grad(self[i] - self[j], pdist, p) * grad[:, None]
    return jnp.zeros_like(self).at[i].add(term).at[j].add(-term)


# ----------------------------------------------------------------------------- samplers


def _uniform_open(key, shape, dtype):
    """Uniform samples in (0, 1) in the opmath type of ``dtype``."""
    compute = opmath_dtype(dtype)
    tiny = jnp.finfo(compute).tiny
    return jax.random.uniform(key, tuple(shape), compute, minval=tiny, maxval=1.0)


@_lowers_free(aten.cauchy.default, random=True)
def cauchy(self, median=0.0, sigma=1.0, *, generator=None, rng_key):
    """Cauchy samples ``median + sigma·tan(π(u - 1/2))``."""
    u = _uniform_open(rng_key, self.shape, self.dtype)
    return (median + sigma * jnp.tan(jnp.pi * (u - 0.5))).astype(self.dtype)


@_lowers_free(aten.geometric.default, random=True)
def geometric(self, p, *, generator=None, rng_key):
    """Number of Bernoulli(``p``) trials up to the first success (values >= 1)."""
    u = _uniform_open(rng_key, self.shape, self.dtype)
    trials = jnp.ceil(jnp.log(u) / jnp.log1p(-jnp.asarray(p, u.dtype)))
    return jnp.maximum(trials, 1).astype(self.dtype)


@_lowers_free(aten.log_normal.default, random=True)
def log_normal(self, mean=1.0, std=2.0, *, generator=None, rng_key):
    """``exp(mean + std·N(0, 1))``."""
    compute = opmath_dtype(self.dtype)
    z = jax.random.normal(rng_key, self.shape, compute)
    return jnp.exp(mean + std * z).astype(self.dtype)
