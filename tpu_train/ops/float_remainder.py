"""C's ``fmod`` on every platform: the remainder of two floats, which is exactly representable.

XLA's remainder is exact on the CPU client (and the CUDA plugin's libdevice ``fmod``); for a TPU
it goes through an approximate quotient, measured on a v5e: ``1e10 % 3`` off by 1023 and
``fmod(2, inf)`` NaN where C gives 1 and 2. There :func:`fmod` takes exact steps instead
(:func:`fmod_by_exact_steps`), chosen when the program is lowered for the platform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tpu_train.ops.conversion import is_integral


def fmod(a, b):
    """``fmod(a, b)`` of two arrays of one dtype (broadcast): the sign of ``a``, exact."""
    a, b = jnp.broadcast_arrays(a, b)
    if is_integral(a.dtype, include_bool=True):
        return lax.rem(a, b)
    return lax.platform_dependent(a, b, tpu=fmod_by_exact_steps, default=lax.rem)


@jax.custom_jvp
def fmod_by_exact_steps(a, b):
    """``fmod`` by binary long division, every step exact.

    ``d`` starts as ``|b|`` scaled by a power of two into ``|a|``'s binade (at most ``|a|``) and
    halves each step down to ``|b|``; ``r`` starts as ``|a|`` and loses ``d`` wherever
    ``r >= d``. Since ``r < 2d`` throughout, each ``r - d`` is exact (Sterbenz), and so is every
    scaling by two. The loop runs as many steps as the widest quotient has bits (at most the
    exponent range, ~280 for float32). Special values as C: a NaN, an infinite ``a`` or a zero
    ``b`` give NaN; a finite ``a`` over an infinite ``b`` gives ``a``."""
    x, y = jnp.abs(a), jnp.abs(b)
    regular = jnp.isfinite(x) & jnp.isfinite(y) & (y != 0)
    x = jnp.where(regular, x, 0)
    y = jnp.where(regular, y, 1)
    _, x_exponent = jnp.frexp(x)
    _, y_exponent = jnp.frexp(y)
    steps = x_exponent - y_exponent
    d = jnp.ldexp(y, jnp.maximum(steps, 0))
    above = d > x
    d = jnp.where(above, d * 0.5, d)
    steps = jnp.where(above, steps - 1, steps)

    def step(carry):
        r, d, k = carry
        return jnp.where((k >= 0) & (r >= d), r - d, r), d * 0.5, k - 1

    r, _, _ = lax.while_loop(lambda carry: jnp.any(carry[2] >= 0), step, (x, d, steps))
    result = jnp.copysign(r, a)
    special = jnp.where(jnp.isinf(b) & jnp.isfinite(a), a, jnp.nan).astype(a.dtype)
    return jnp.where(regular, result, special)


@fmod_by_exact_steps.defjvp
def _fmod_jvp(primals, tangents):
    # PyTorch's derivatives (C's fmod(a, b) = a - trunc(a / b) * b): 1 for a, -trunc(a / b)
    # for b; the loop itself cannot be differentiated in reverse.
    a, b = primals
    da, db = tangents
    return fmod_by_exact_steps(a, b), da - jnp.trunc(a / b) * db
