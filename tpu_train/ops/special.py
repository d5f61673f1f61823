"""Special functions: ``special_*`` ops, ``polygamma``, ``igamma``/``igammac``, orthogonal polynomials.

Integer and bool inputs compute in float32, as PyTorch's unary float ops do. The orthogonal
polynomial ops (``special_chebyshev_polynomial_t`` and friends) follow ATen's scalar kernels
branch for branch: ``n`` is truncated to an integer, ``n < 0`` gives 0, the boundary values
at ``x = ±1`` are exact, Chebyshev polynomials of high degree inside ``(-1, 1)`` use the
trigonometric closed form and every other case runs the three-term recurrence, here as one
``while_loop`` over the largest degree with each element frozen once its own degree is reached.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.scipy import special as jsp

from tpu_train.ops.conversion import float_result_dtype, opmath_dtype, promote
from tpu_train.ops.registry import aten, get_lowering, is_mutating, lowers


def _lowers_free(*ops):
    """``lowers`` for the overloads no other family lowered yet (those are left alone)."""
    overloads = []
    for op in ops:
        names = op.overloads() if hasattr(op, "overloads") else None
        candidates = [getattr(op, n) for n in names] if names is not None else [op]
        overloads += [o for o in candidates if get_lowering(o) is None and not is_mutating(o)]
    return lowers(*overloads) if overloads else (lambda fn: fn)


def _float_unary(compute):
    def lowering(self):
        dtype = float_result_dtype(self.dtype)
        return compute(self.astype(opmath_dtype(dtype))).astype(dtype)

    return lowering


def _register_unary(op, compute, name):
    lowering = _float_unary(compute)
    lowering.__name__ = lowering.__qualname__ = name
    lowering.__doc__ = f"``{op}`` (integers compute in float32)."
    _lowers_free(op)(lowering)


def _ndtri(p):
    # XLA's ndtri returns ±inf just inside (0, 1) less accurately than needed near the ends;
    # PyTorch: ndtri(0) = -inf, ndtri(1) = inf, outside [0, 1] NaN.
    out = jsp.ndtri(p)
    out = jnp.where(p == 0, -jnp.inf, jnp.where(p == 1, jnp.inf, out))
    return jnp.where((p < 0) | (p > 1), jnp.nan, out)


def _erfcx(x):
    """``exp(x²)·erfc(x)``; above 8 the asymptotic series (XLA's kernel drops to 0 near 9.3)."""
    safe = jnp.where(x > 8, x, 8.0)
    z = 1 / (2 * safe * safe)
    series = 1 - z * (1 - 3 * z * (1 - 5 * z * (1 - 7 * z * (1 - 9 * z))))
    return jnp.where(x > 8, series / (safe * jnp.sqrt(jnp.pi)), jsp.erfcx(x))


def _spherical_bessel_j0(x):
    """sin(x)/x with a Taylor series near 0 and 0 at ±inf."""
    x2 = x * x
    series = 1 + x2 * (-1 / 6 + x2 * (1 / 120 + x2 * (-1 / 5040 + x2 * (1 / 362880))))
    safe = jnp.where(jnp.abs(x) < 0.5, 1.0, x)
    out = jnp.where(jnp.abs(x) < 0.5, series, jnp.sin(safe) / safe)
    return jnp.where(jnp.isinf(x), 0.0, out)


_UNARY = {
    aten.special_erfcx.default: _erfcx,
    aten.special_i0e.default: jsp.i0e,
    aten.special_i1.default: jsp.i1,
    aten.special_i1e.default: jsp.i1e,
    aten.special_ndtri.default: _ndtri,
    aten.special_log_ndtr.default: jsp.log_ndtr,
    aten.special_ndtr.default: jsp.ndtr,
    aten.special_entr.default: jsp.entr,
    aten.special_modified_bessel_i0.default: jsp.i0,
    aten.special_modified_bessel_i1.default: jsp.i1,
    aten.special_spherical_bessel_j0.default: _spherical_bessel_j0,
}

for _op, _fn in _UNARY.items():
    _register_unary(_op, _fn, _op._schema.name.split("::")[1])


# ----------------------------------------------------------------------------- binary


def _binary_float(a, b):
    a, b = jnp.asarray(a), jnp.asarray(b)
    dtype, compute, (a, b), _ = promote(a, b, to_float=True)
    return dtype, a, b


def _hurwitz_zeta(s, q):
    """``ζ(s, q) = Σ_k (q + k)^-s`` as ATen computes it, also for negative ``q``.

    For ``q < 0`` the terms up to ``q + k >= 9`` are summed explicitly (``s`` must then be an
    integer, else NaN; the small ``|q + k|`` dominate, so they are not left to the asymptotic
    tail) and the rest is ``ζ(s, q + k)``; non-positive integer ``q`` is a pole (+inf).
    """
    negative = q < 0
    shift = jnp.where(negative, jnp.ceil(9 - q), 0)
    total = jnp.max(shift) if shift.size else jnp.zeros((), shift.dtype)
    odd = jnp.mod(s, 2) == 1

    def body(carry):
        k, acc = carry
        base = q + k
        term = jnp.abs(base) ** -s
        term = jnp.where(odd & (base < 0), -term, term)
        return k + 1, acc + jnp.where(k < shift, term, 0)

    _, head = lax.while_loop(lambda c: c[0] < total, body,
                             (jnp.zeros((), q.dtype), jnp.zeros_like(q + s)))
    out = head + jsp.zeta(s, q + shift)
    out = jnp.where(negative & (s != jnp.floor(s)), jnp.nan, out)
    return jnp.where((q <= 0) & (q == jnp.floor(q)), jnp.inf, out)


@_lowers_free(aten.polygamma.default)
def polygamma(n, self):
    """``polygamma(n, x) = (-1)^(n+1) n! ζ(n + 1, x)``; digamma for ``n = 0`` (∓inf at ±0)."""
    dtype = float_result_dtype(self.dtype)
    x = self.astype(opmath_dtype(dtype))
    if n == 0:
        out = jnp.where(x == 0, jnp.copysign(jnp.inf, -x), lax.digamma(x))
    else:
        sign = 1.0 if n % 2 == 1 else -1.0
        out = sign * math.factorial(n) * _hurwitz_zeta(jnp.asarray(n + 1, x.dtype), x)
    return out.astype(dtype)


@_lowers_free(aten.special_zeta)
def special_zeta(self, other):
    """Hurwitz zeta ``ζ(x, q)``; the Scalar overloads share this lowering."""
    dtype, x, q = _binary_float(self, other)
    x, q = jnp.broadcast_arrays(x, q)
    return _hurwitz_zeta(x, q).astype(dtype)


@_lowers_free(aten.igamma.default)
def igamma(self, other):
    """Regularized lower incomplete gamma ``P(a, x)``."""
    dtype, a, x = _binary_float(self, other)
    return jsp.gammainc(a, x).astype(dtype)


@_lowers_free(aten.igammac.default)
def igammac(self, other):
    """Regularized upper incomplete gamma ``Q(a, x)``."""
    dtype, a, x = _binary_float(self, other)
    return jsp.gammaincc(a, x).astype(dtype)


# ----------------------------------------------------------------------------- polynomials


def _recurrence(n, q1, step, stop_on_nan=True):
    """``P_n`` from ``P_0 = 1``, ``P_1 = q1`` and ``P_{k+1} = step(k, P_{k-1}, P_k)``.

    ``n`` is an integer array broadcast with ``q1``; elements with ``n < 2`` return ``q1``
    (callers handle 0, 1 and negative degrees). The loop runs ``max(n) - 1`` times.
    """
    steps = jnp.where(n >= 2, n - 1, 0)
    total = jnp.max(steps) if steps.size else jnp.zeros((), steps.dtype)
    one = jnp.ones_like(q1)

    def body(carry):
        k, p, q = carry
        r = step(k.astype(q.dtype), p, q)
        active = k <= steps
        if stop_on_nan:
            active = active & ~jnp.isnan(q)
        return k + 1, jnp.where(active, q, p), jnp.where(active, r, q)

    _, _, q = lax.while_loop(lambda c: c[0] <= total, body, (jnp.ones((), steps.dtype), one, q1))
    return q


def _poly_args(x, n):
    """Promote ``x`` and ``n`` (either may be a Scalar); ``n`` truncated to int32.

    Non-finite ``n`` becomes -1 (so the result is 0), as the Hermite kernels say explicitly.
    """
    x, n = jnp.asarray(x), jnp.asarray(n)
    dtype, compute, (xc, nc), _ = promote(x, n, to_float=True)
    xc, nc = jnp.broadcast_arrays(xc, nc)
    finite = jnp.isfinite(nc)
    limit = jnp.float32(2 ** 30)
    ni = jnp.where(finite, jnp.trunc(jnp.clip(nc, -limit, limit)), -1).astype(jnp.int32)
    return dtype, xc, ni


def _finish(out, x, n, dtype):
    """Degree 0 gives 1 and a negative degree 0, before any other case."""
    out = jnp.where(n == 0, jnp.ones_like(x), out)
    return jnp.where(n < 0, jnp.zeros_like(x), out).astype(dtype)


def _chebyshev(kind, y, n, at_plus, at_minus, threshold, fallback):
    """Chebyshev polynomial of ``kind`` ('t', 'u', 'v', 'w') at ``y``.

    ``at_plus`` / ``at_minus`` mark the elements ATen treats as ``y = 1`` / ``y = -1`` (for the
    shifted polynomials it tests ``x == 1`` / ``x == 0``); above degree ``threshold`` and inside
    ``(-1, 1)`` the closed form in ``θ = acos(y)`` is used, with ``fallback`` where its
    denominator vanishes.
    """
    nf = n.astype(y.dtype)
    sign = jnp.where(n % 2 == 0, 1.0, -1.0).astype(y.dtype)
    plus = {"t": jnp.ones_like(y), "u": nf + 1, "v": jnp.ones_like(y), "w": nf + nf + 1}[kind]
    minus = {"t": sign, "u": sign * (nf + 1), "v": sign * (nf + nf + 1), "w": sign}[kind]
    q1 = {"t": y, "u": y + y, "v": y + y - 1, "w": y + y + 1}[kind]
    theta = jnp.arccos(jnp.clip(y, -1, 1))
    if kind == "t":
        closed = jnp.cos(nf * theta)
    elif kind == "u":
        s = jnp.sin(theta)
        closed = jnp.where(s != 0, jnp.sin((nf + 1) * theta) / jnp.where(s != 0, s, 1),
                           (nf + 1) * jnp.cos((nf + 1) * theta) / y)
    elif kind == "v":
        closed = jnp.where(jnp.sin(theta / 2) != 1,
                           jnp.cos((nf + 0.5) * theta) / jnp.cos(theta / 2), sign * (nf + nf + 1))
    else:
        c = jnp.cos(theta / 2)
        closed = jnp.where(c != 1, jnp.sin((nf + 0.5) * theta) / jnp.sin(theta / 2),
                           fallback(nf, sign))
    use_closed = (n > threshold) & (jnp.abs(y) < 1)
    loop_n = jnp.where(use_closed | at_plus | at_minus, 0, n)
    rec = _recurrence(loop_n, q1, lambda k, p, q: (y + y) * q - p)
    out = jnp.where(n == 1, q1, rec)
    out = jnp.where(use_closed, closed, out)
    out = jnp.where(at_minus, minus, out)
    return jnp.where(at_plus, plus, out)


def _register_chebyshev(op, kind, shifted, threshold):
    def lowering(x, n):
        dtype, x, n = _poly_args(x, n)
        y = x + x - 1 if shifted else x
        if shifted:
            at_plus, at_minus = x == 1, x == 0
        else:
            at_plus, at_minus = x == 1, x == -1
        if kind == "w" and not shifted:
            fallback = lambda nf, sign: jnp.where(x > 0, nf + nf + 1, sign)  # noqa: E731
        else:
            fallback = lambda nf, sign: sign  # noqa: E731
        out = _chebyshev(kind, y, n, at_plus, at_minus, threshold, fallback)
        return _finish(out, x, n, dtype)

    name = op.__name__
    lowering.__name__ = lowering.__qualname__ = name
    lowering.__doc__ = f"``{name}(x, n)`` (Tensor and Scalar overloads)."
    _lowers_free(op)(lowering)


for _kind, _plain_threshold, _shifted_threshold in (("t", 6, 6), ("u", 8, 6), ("v", 8, 6),
                                                     ("w", 8, 4)):
    _register_chebyshev(getattr(aten, f"special_chebyshev_polynomial_{_kind}"), _kind, False,
                        _plain_threshold)
    _register_chebyshev(getattr(aten, f"special_shifted_chebyshev_polynomial_{_kind}"), _kind,
                        True, _shifted_threshold)


_HERMITE_LIMIT = 128  # ATen's float32 limit on the degree (above it: NaN)


@_lowers_free(aten.special_hermite_polynomial_h)
def special_hermite_polynomial_h(x, n):
    """Physicists' Hermite ``H_n(x)``: ``H_{k+1} = 2x H_k - 2k H_{k-1}``."""
    dtype, x, n = _poly_args(x, n)
    big = n > _HERMITE_LIMIT
    rec = _recurrence(jnp.where(big, 0, n), x + x, lambda k, p, q: (x + x) * q - (k + k) * p,
                      stop_on_nan=False)
    out = jnp.where(big, jnp.nan, rec)
    return _finish(out, x, n, dtype)


@_lowers_free(aten.special_hermite_polynomial_he)
def special_hermite_polynomial_he(x, n):
    """Probabilists' Hermite ``He_n(x)``: ``He_{k+1} = x He_k - k He_{k-1}``."""
    dtype, x, n = _poly_args(x, n)
    big = n > _HERMITE_LIMIT
    rec = _recurrence(jnp.where(big, 0, n), x, lambda k, p, q: x * q - k * p, stop_on_nan=False)
    out = jnp.where(big, jnp.nan, rec)
    return _finish(out, x, n, dtype)


@_lowers_free(aten.special_laguerre_polynomial_l)
def special_laguerre_polynomial_l(x, n):
    """Laguerre ``L_n(x)``; ``L_n(0) = 1`` for ``n >= 0``."""
    dtype, x, n = _poly_args(x, n)
    rec = _recurrence(n, 1 - x, lambda k, p, q: ((k + k + (1 - x)) * q - k * p) / (k + 1))
    out = jnp.where(x == 0, jnp.ones_like(x), rec)
    return _finish(out, x, n, dtype)


@_lowers_free(aten.special_legendre_polynomial_p)
def special_legendre_polynomial_p(x, n):
    """Legendre ``P_n(x)``; exact ``±1`` at ``x = ±1``."""
    dtype, x, n = _poly_args(x, n)
    sign = jnp.where((x > 0) | (n % 2 == 0), 1.0, -1.0).astype(x.dtype)
    edge = jnp.abs(x) == 1
    rec = _recurrence(jnp.where(edge, 0, n), x,
                      lambda k, p, q: ((k + k + 1) * x * q - k * p) / (k + 1))
    out = jnp.where(edge, sign, rec)
    return _finish(out, x, n, dtype)
