#!/usr/bin/env python
"""Regenerate the Chebyshev coefficient tables of ``tpu_train/ops/bessel.py``.

Each table interpolates a smooth remainder of the function (see that module's docstring) at
Chebyshev points of ``t ∈ [-1, 1]`` against scipy.special in float64. Prints the tables as
Python source and, on stderr, each fit's largest error on a fine interior grid.

    python tests/ops/bessel_fits.py > /tmp/tables.py
"""

from __future__ import annotations

import sys

import numpy as np
from numpy.polynomial import chebyshev
from scipy import special as sp

J_SPLIT, K_SPLIT, AI_LO, AI_HI = 8.0, 2.0, -4.0, 2.0


def _fit(name, f, degree):
    coeffs = chebyshev.chebinterpolate(f, degree)
    # Away from t = -1, where the references lose accuracy (x → 0 or ∞).
    t = np.linspace(-0.999, 1, 20001)
    err = np.nanmax(np.abs(chebyshev.chebval(t, coeffs) - f(t)))
    print(f"{name}: degree {degree}, max abs error {err:.1e}", file=sys.stderr)
    return name, coeffs


def _j_small_x(t):  # t = x²/32 - 1 on [0, 8]
    return np.sqrt(np.maximum((t + 1) * J_SPLIT ** 2 / 2, 1e-300))


def _j_large_x(t):  # t = 2·64/x² - 1 on (8, inf)
    return J_SPLIT / np.sqrt(np.maximum((t + 1) / 2, 1e-300))


def _modulus(order, x):
    """``P_n(x)``, ``x·Q_n(x)`` of ``J_n = sqrt(2/(πx))(P cos χ - Q sin χ)``, ``Y_n`` alike."""
    j, y = (sp.j0, sp.y0) if order == 0 else (sp.j1, sp.y1)
    chi = x - (2 * order + 1) * np.pi / 4
    scale = np.sqrt(np.pi * x / 2)
    p = scale * (j(x) * np.cos(chi) + y(x) * np.sin(chi))
    q = scale * (y(x) * np.cos(chi) - j(x) * np.sin(chi))
    return p, x * q


def _k_small_x(t):  # t = x²/2 - 1 on (0, 2]
    return np.sqrt(np.maximum((t + 1) * K_SPLIT ** 2 / 2, 1e-300))


def _k_large_x(t):  # t = 4/x - 1 on (2, inf)
    return 2 * K_SPLIT / np.maximum(t + 1, 1e-300)


def _airy_x(t, zeta_edge):  # t = 2ζ_edge/ζ - 1, ζ = ⅔|x|^(3/2)
    return (1.5 * zeta_edge / np.maximum((t + 1) / 2, 1e-300)) ** (2 / 3)


def _airy_oscillating(z):
    """``P``, ``ζ·Q`` of ``Ai(-z) = (sin θ·P - cos θ·Q)/(√π z^¼)``, ``θ = ζ + π/4``."""
    ai, _, bi, _ = sp.airy(-z)
    zeta = 2 / 3 * z ** 1.5
    theta = zeta + np.pi / 4
    scale = np.sqrt(np.pi) * z ** 0.25
    p = scale * (np.sin(theta) * ai + np.cos(theta) * bi)
    q = scale * (np.sin(theta) * bi - np.cos(theta) * ai)
    return p, zeta * q


def tables():
    js, jl, ks, kl = _j_small_x, _j_large_x, _k_small_x, _k_large_x
    zeta_hi, zeta_lo = 2 / 3 * AI_HI ** 1.5, 2 / 3 * (-AI_LO) ** 1.5
    return [
        _fit("_J0_SMALL", lambda t: sp.j0(js(t)), 12),
        _fit("_Y0_SMALL", lambda t: sp.y0(js(t)) - 2 / np.pi * np.log(js(t)) * sp.j0(js(t)), 12),
        _fit("_J1_SMALL", lambda t: sp.j1(js(t)) / js(t), 12),
        _fit("_Y1_SMALL", lambda t: (sp.y1(js(t)) - 2 / np.pi * (np.log(js(t)) * sp.j1(js(t))
                                                                 - 1 / js(t))) / js(t), 12),
        _fit("_P0", lambda t: _modulus(0, jl(t))[0], 6),
        _fit("_Q0", lambda t: _modulus(0, jl(t))[1], 6),
        _fit("_P1", lambda t: _modulus(1, jl(t))[0], 6),
        _fit("_Q1", lambda t: _modulus(1, jl(t))[1], 6),
        _fit("_K0_SMALL", lambda t: sp.k0(ks(t)) + np.log(ks(t) / 2) * sp.i0(ks(t)), 8),
        _fit("_K1_SMALL", lambda t: (sp.k1(ks(t)) - np.log(ks(t) / 2) * sp.i1(ks(t))
                                     - 1 / ks(t)) / ks(t), 8),
        _fit("_K0_LARGE", lambda t: sp.k0e(kl(t)) * np.sqrt(kl(t)), 11),
        _fit("_K1_LARGE", lambda t: sp.k1e(kl(t)) * np.sqrt(kl(t)), 11),
        _fit("_AI_MID", lambda t: sp.airy(AI_LO + (t + 1) / 2 * (AI_HI - AI_LO))[0], 22),
        _fit("_AI_POS", lambda t: (sp.airye(_airy_x(t, zeta_hi))[0] * 2 * np.sqrt(np.pi)
                                   * _airy_x(t, zeta_hi) ** 0.25), 10),
        _fit("_AI_NEG_P", lambda t: _airy_oscillating(_airy_x(t, zeta_lo))[0], 10),
        _fit("_AI_NEG_Q", lambda t: _airy_oscillating(_airy_x(t, zeta_lo))[1], 10),
    ]


def main():
    for name, coeffs in tables():
        print(f"{name} = (")
        line = "   "
        for c in coeffs:
            item = f" {float(c)!r},"
            if len(line) + len(item) > 96:
                print(line)
                line = "   "
            line += item
        print(line)
        print(")")


if __name__ == "__main__":
    main()
