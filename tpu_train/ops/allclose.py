"""``allclose``: one bool for the whole comparison (the device layer hands it back as such)."""

from __future__ import annotations

import jax.numpy as jnp

from tpu_train.ops.registry import aten, lowers


@lowers(aten.allclose.default)
def allclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    """``all(|self - other| <= atol + rtol·|other|)`` after broadcasting, as ``isclose`` says:
    equal values (infinities of one sign too) are close, other non-finite values are not, and
    NaNs are close to NaNs only with ``equal_nan``."""
    a, b = jnp.broadcast_arrays(self, other)
    dtype = jnp.promote_types(a.dtype, b.dtype)
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.float32
    a, b = a.astype(dtype), b.astype(dtype)
    close = a == b
    if equal_nan:
        close |= jnp.isnan(a) & jnp.isnan(b)
    finite = jnp.isfinite(a) & jnp.isfinite(b)
    close |= finite & (jnp.abs(a - b) <= atol + rtol * jnp.abs(b))
    return jnp.all(close)
