"""``rrelu_with_noise_functional``: leaky ReLU with a random slope per negative element."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpu_train.ops.conversion import opmath_dtype
from tpu_train.ops.registry import aten, lowers


@lowers(aten.rrelu_with_noise_functional.default, random=True)
def rrelu_with_noise_functional(self, noise, lower=0.125, upper=1 / 3, training=False,
                                generator=None, *, rng_key):
    """Returns ``(output, noise)``.

    Training: each element ``<= 0`` is scaled by a slope drawn uniformly from
    ``[lower, upper)``, which is also its noise entry; the others pass with noise 1. Otherwise
    the slope is ``(lower + upper) / 2`` everywhere and ``noise`` comes back unchanged.
    """
    compute = opmath_dtype(self.dtype)
    x = self.astype(compute)
    if not training:
        slope = (jnp.asarray(lower, compute) + jnp.asarray(upper, compute)) / 2
        return jnp.where(x >= 0, x, x * slope).astype(self.dtype), noise
    low, high = jnp.asarray(lower, compute), jnp.asarray(upper, compute)
    slope = low + jax.random.uniform(rng_key, x.shape, compute) * (high - low)
    slope = jnp.where(x <= 0, slope, 1)
    return (x * slope).astype(self.dtype), slope.astype(noise.dtype)
