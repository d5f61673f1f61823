"""Bessel functions of the first and second kind, modified Bessel K, and Airy Ai.

``special_bessel_j0/j1/y0/y1``, ``special_modified_bessel_k0/k1``, their exponentially scaled
forms and ``special_airy_ai``. XLA has none of them, so each is a Chebyshev series on a bounded
interval plus, past it, the leading asymptotic form times a slowly varying correction that is
itself a Chebyshev series in an inverse power of ``x``:

* ``J_n``, ``Y_n`` on ``|x| <= 8``: series in ``x²`` after taking out the ``log x`` (and ``1/x``)
  singularity of ``Y_n``; beyond, ``sqrt(2/(πx))·(P_n cos χ - Q_n sin χ)`` (``Y_n`` with the
  sine and cosine swapped), ``χ = x - (2n+1)π/4``, ``P_n``, ``x·Q_n`` series in ``64/x²``;
* ``K_n`` on ``x <= 2``: series in ``x²`` after taking out ``log(x/2) · I_n`` (and ``1/x``); beyond,
  ``e^-x/sqrt(x)`` times a series in ``4/x``;
* ``Ai`` on ``[-4, 2]``: a series in ``x``; beyond, ``e^-ζ/(2√π x^¼)`` resp. the oscillating
  ``(sin(ζ+π/4)·P - cos(ζ+π/4)·Q)/(√π |x|^¼)``, ``ζ = ⅔|x|^(3/2)``, corrections in ``1/ζ``.

The coefficients are Chebyshev interpolants of double-precision references (scipy.special),
fitted for this module (tests/ops/bessel_fits.py regenerates them); each series is accurate to
about 1e-8 relative (or absolute near a zero), so the results have float32 accuracy, also for
float64 inputs. Integer and bool inputs compute in float32; domain edges (``Y_n``, ``K_n`` at
0 → ∓inf/inf, below 0 → NaN) follow ATen. The phase ``x - (2n+1)π/4`` is rounded in the working
precision as ATen's kernels do, so large arguments agree with CPU PyTorch as far as that allows.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.scipy import special as jsp

from tpu_train.ops.conversion import float_result_dtype, opmath_dtype
from tpu_train.ops.registry import aten, lowers



def _cheb(coeffs, t):
    """``Σ c_k T_k(t)`` by Clenshaw's recurrence."""
    b1, b2 = jnp.zeros_like(t), jnp.zeros_like(t)
    for c in coeffs[:0:-1]:
        b1, b2 = 2 * t * b1 - b2 + c, b1
    return t * b1 - b2 + coeffs[0]


def _float_unary(name):
    """Register ``compute`` as the lowering of ``aten.<name>.default`` (float opmath)."""

    def register(compute):
        def lowering(self):
            dtype = float_result_dtype(self.dtype)
            return compute(self.astype(opmath_dtype(dtype))).astype(dtype)

        lowering.__name__ = lowering.__qualname__ = name
        lowering.__doc__ = f"``{name}`` ({compute.__doc__})"
        lowers(getattr(aten, name).default)(lowering)
        return compute

    return register


# ----------------------------------------------------------------------------- J and Y

_SPLIT = 8.0  # the series in x² below, the asymptotic form above

_J0_SMALL = (
    0.15772797147489007, -0.008723442352851999, 0.2651786132033366, -0.37009499387264966,
    0.15806710233209714, -0.03489376941140874, 0.004819180069467418, -0.0004606261662062459,
    3.246032882090728e-05, -1.7619469078313722e-06, 7.608163595544487e-08,
    -2.6792528212121922e-09, 7.8445848791981e-11,
)
_Y0_SMALL = (
    -0.033146113203284894, -0.2744743055297455, 0.1790343140771826, 0.2615673462550468,
    -0.17730201278114371, 0.04719668959576324, -0.007287962479552023, 0.0007531135932579529,
    -5.6320791410744314e-05, 3.2065325377395113e-06, -1.4407233261924473e-07,
    5.2487930979577355e-09, -1.5828801296985763e-10,
)
_J1_SMALL = (
    0.08104484632565809, -0.14897514506765203, 0.16099926235720963, -0.08268049176681785,
    0.022213639654965946, -0.0036469406007692065, 0.0004050337728354, -3.2555548668486535e-05,
    1.9858774049057574e-06, -9.521984753628851e-08, 3.687133767634863e-09,
    -1.1780268951669492e-10, 3.1588377421347954e-12,
)
_Y1_SMALL = (
    0.002538013235741803, -0.016087173047668782, -0.09591204536083073, 0.08445197259652351,
    -0.028328123944594365, 0.005289897544167104, -0.0006414551451326012, 5.505982873340361e-05,
    -3.538080018695438e-06, 1.7707804559978133e-07, -7.110550070628541e-09,
    2.3443376046770595e-10, -6.462133805225435e-12,
)
_P0 = (
    0.9994603493475187, -0.0005365220468129499, 3.0751847874662834e-06, -5.170594533484721e-08,
    1.6306458722985845e-09, -7.863596282068182e-11, 5.12507496759034e-12,
)
_Q0 = (
    -0.124446836842696, 0.0005470815954088382, -5.931598729078906e-06, 1.437796572594558e-07,
    -5.817527933588933e-09, 3.375756598858867e-10, -2.5387224069005144e-11,
)
_P1 = (
    1.0009030408600135, 0.000898989833085752, -3.987284300447211e-06, 6.177633940903807e-08,
    -1.8718900080776687e-09, 8.816363512258768e-11, -5.657791695463337e-12,
)
_Q1 = (
    0.37422229655628286, -0.0007702178839325795, 7.310892205902864e-06, -1.6767825027670063e-07,
    6.583349817671344e-09, -3.748724664021097e-10, 2.7833695665740218e-11,
)


def _small_t(ax):
    return jnp.minimum(ax, _SPLIT) ** 2 / (_SPLIT * _SPLIT / 2) - 1


def _oscillating(ax, order, p, q, second_kind):
    """``J_n`` (or ``Y_n``) for ``ax > 8`` from the modulus corrections ``P_n``, ``x·Q_n``."""
    safe = jnp.maximum(ax, _SPLIT)
    t = 2 * (_SPLIT / safe) ** 2 - 1
    pn, qn = _cheb(p, t), _cheb(q, t) / safe
    chi = safe - (0.25 if order == 0 else 0.75) * math.pi
    c, s = jnp.cos(chi), jnp.sin(chi)
    wave = pn * s + qn * c if second_kind else pn * c - qn * s
    return math.sqrt(2 / math.pi) / jnp.sqrt(safe) * wave


def _j0(x):
    ax = jnp.abs(x)
    return jnp.where(ax <= _SPLIT, _cheb(_J0_SMALL, _small_t(ax)),
                     _oscillating(ax, 0, _P0, _Q0, False))


def _j1(x):
    ax = jnp.abs(x)
    out = jnp.where(ax <= _SPLIT, ax * _cheb(_J1_SMALL, _small_t(ax)),
                    _oscillating(ax, 1, _P1, _Q1, False))
    return jnp.where(x < 0, -out, out)


def _second_kind_edges(x, out):
    """``Y_n(0) = -inf``, ``Y_n(x < 0) = NaN`` (NaN stays NaN)."""
    return jnp.where(x == 0, -jnp.inf, jnp.where((x < 0) | jnp.isnan(x), jnp.nan, out))


@_float_unary("special_bessel_j0")
def bessel_j0(x):
    """Bessel function of the first kind of order 0"""
    return _j0(x)


@_float_unary("special_bessel_j1")
def bessel_j1(x):
    """Bessel function of the first kind of order 1"""
    return _j1(x)


@_float_unary("special_bessel_y0")
def bessel_y0(x):
    """Bessel function of the second kind of order 0"""
    safe = jnp.where(x > 0, x, 1.0)
    small = (2 / math.pi) * jnp.log(safe) * _j0(safe) + _cheb(_Y0_SMALL, _small_t(safe))
    out = jnp.where(safe <= _SPLIT, small, _oscillating(safe, 0, _P0, _Q0, True))
    return _second_kind_edges(x, out)


@_float_unary("special_bessel_y1")
def bessel_y1(x):
    """Bessel function of the second kind of order 1"""
    safe = jnp.where(x > 0, x, 1.0)
    singular = (2 / math.pi) * (jnp.log(safe) * _j1(safe) - 1 / safe)
    small = singular + safe * _cheb(_Y1_SMALL, _small_t(safe))
    out = jnp.where(safe <= _SPLIT, small, _oscillating(safe, 1, _P1, _Q1, True))
    return _second_kind_edges(x, out)


# ----------------------------------------------------------------------------- K

_K0_SMALL = (
    -0.26766369661695133, 0.3442898999246285, 0.03597993651536155, 0.0012646154114468358,
    2.2862121031278135e-05, 2.5347910776584485e-07, 1.9045163902563096e-09,
    1.034951253113678e-11, 4.2755882474375815e-14,
)
_K1_SMALL = (
    -0.06409034516866274, -0.10916919599320069, -0.006636878452818, -0.00016822792382041412,
    -2.389559180978443e-06, -2.18535688142254e-08, -1.3982282542033616e-10,
    -6.616459295060341e-13, -2.468720801654634e-15,
)
_K0_LARGE = (
    1.2201515410329777, -0.03144810131196448, 0.0015698838857299228, -0.00012849549581607964,
    1.3949813718254026e-05, -1.8317555207462515e-06, 2.766813572326517e-07,
    -4.66048766615638e-08, 8.573952683249564e-09, -1.6972365735057338e-09,
    3.5659817922602716e-10, -7.506025430833081e-11,
)
_K1_LARGE = (
    1.3603130952422215, 0.10392373657681724, -0.0028578168596228304, 0.00019521551847108873,
    -1.9361979741232733e-05, 2.4064849457975748e-06, -3.501960537851308e-07,
    5.7410816434178e-08, -1.0345673773689187e-08, 2.014714839404519e-09,
    -4.1774763278231336e-10, 8.70434095171883e-11,
)


def _k_scaled(x, order):
    """``e^x K_n(x)`` for ``x > 0``, split at 2."""
    small_x = jnp.minimum(x, 2.0)
    t = small_x * small_x / 2 - 1
    if order == 0:
        small = _cheb(_K0_SMALL, t) - jnp.log(small_x / 2) * jsp.i0(small_x)
    else:
        small = (jnp.log(small_x / 2) * jsp.i1(small_x) + 1 / small_x
                 + small_x * _cheb(_K1_SMALL, t))
    large_x = jnp.maximum(x, 2.0)
    large = _cheb(_K0_LARGE if order == 0 else _K1_LARGE, 4 / large_x - 1) / jnp.sqrt(large_x)
    return jnp.where(x <= 2, jnp.exp(small_x) * small, large)


def _k(x, order, scaled):
    safe = jnp.where(x > 0, x, 1.0)
    out = _k_scaled(safe, order)
    if not scaled:
        # e^-x underflows (to 0 past x ≈ 104 in float32) as ATen's float kernel does.
        out = jnp.exp(-safe) * out
    out = jnp.where(jnp.isinf(x), 0.0, out)
    return jnp.where(x == 0, jnp.inf, jnp.where((x < 0) | jnp.isnan(x), jnp.nan, out))


@_float_unary("special_modified_bessel_k0")
def modified_bessel_k0(x):
    """modified Bessel function of the second kind of order 0"""
    return _k(x, 0, False)


@_float_unary("special_modified_bessel_k1")
def modified_bessel_k1(x):
    """modified Bessel function of the second kind of order 1"""
    return _k(x, 1, False)


@_float_unary("special_scaled_modified_bessel_k0")
def scaled_modified_bessel_k0(x):
    """``e^x K_0(x)``"""
    return _k(x, 0, True)


@_float_unary("special_scaled_modified_bessel_k1")
def scaled_modified_bessel_k1(x):
    """``e^x K_1(x)``"""
    return _k(x, 1, True)


# ----------------------------------------------------------------------------- Ai

_AI_LO, _AI_HI = -4.0, 2.0  # the series in x between, asymptotic forms outside
_ZETA_LO, _ZETA_HI = 2 / 3 * (-_AI_LO) ** 1.5, 2 / 3 * _AI_HI ** 1.5

_AI_MID = (
    0.06078525685079724, 0.18996030881729126, -0.25092438703233605, -0.09512014013503049,
    0.20236324198370073, -0.06418728306305253, -0.02681470318603993, 0.024051904281273816,
    -0.004132591649748823, -0.0020196817905495236, 0.001125076875065629, -0.0001169753870969075,
    -7.125499253057711e-05, 2.8167833106971532e-05, -1.7594742389938174e-06,
    -1.458720152474791e-06, 4.3887479586974904e-07, -1.4627095932118677e-08,
    -1.949599374120266e-08, 4.660559549999863e-09, -5.106723166317782e-11,
    -1.8364228435031942e-10, 3.713823979625468e-11,
)
_AI_POS = (
    0.9844053049171496, -0.014792784850114675, 0.0007327177465332533, -6.125954234699597e-05,
    6.834766967369419e-06, -9.237229590119966e-07, 1.4362248109992234e-07,
    -2.4892995331704526e-08, 4.709064471697388e-09, -9.555557355479425e-10,
    1.9612377378696135e-10,
)
_AI_NEG_P = (
    0.9995276946111581, -0.0006253655777646634, -0.00014990980351684254, 3.4830039930796888e-06,
    2.98606015257764e-07, -3.4166717939724964e-08, 2.337740102508302e-10, 3.453256367726774e-10,
    -4.3557107415830906e-11, 6.66941249702094e-14, 8.679017100958348e-13,
)
_AI_NEG_Q = (
    0.06897650499795521, -0.0006157426372287949, -0.00014201885388041467, 6.303142935503512e-06,
    4.3480850056313e-07, -8.234413671885528e-08, 2.784055467224872e-09, 8.630623100661347e-10,
    -1.6018811529764062e-10, 2.977036546573815e-12, 4.96770112419624e-12,
)


@_float_unary("special_airy_ai")
def airy_ai(x):
    """Airy function Ai; NaN at ±inf as in ATen"""
    mid_x = jnp.clip(x, _AI_LO, _AI_HI)
    mid = _cheb(_AI_MID, (2 * mid_x - (_AI_LO + _AI_HI)) / (_AI_HI - _AI_LO))
    # x > 2: Ai = e^-ζ / (2√π x^¼) · F(ζ_hi/ζ)
    pos_x = jnp.maximum(x, _AI_HI)
    root = jnp.sqrt(pos_x)
    zeta = 2 / 3 * pos_x * root
    f = _cheb(_AI_POS, 2 * _ZETA_HI / zeta - 1)
    pos = jnp.exp(-zeta) * f / (2 * math.sqrt(math.pi) * jnp.sqrt(root))
    # x < -4: Ai = (sin(ζ + π/4)·P - cos(ζ + π/4)·Q) / (√π |x|^¼)
    z = jnp.maximum(-x, -_AI_LO)
    root = jnp.sqrt(z)
    zeta = 2 / 3 * z * root
    t = 2 * _ZETA_LO / zeta - 1
    phase = zeta + 0.25 * math.pi
    wave = jnp.sin(phase) * _cheb(_AI_NEG_P, t) - jnp.cos(phase) * _cheb(_AI_NEG_Q, t) / zeta
    neg = wave / (math.sqrt(math.pi) * jnp.sqrt(root))
    out = jnp.where(x < _AI_LO, neg, jnp.where(x > _AI_HI, pos, mid))
    return jnp.where(jnp.isinf(x), jnp.nan, out)
