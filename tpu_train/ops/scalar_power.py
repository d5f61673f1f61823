"""Powers of a number known on the host raised to whole-number float32 exponents, correctly
rounded to float32 but for ties closer than ~2**-40 of the value (float-float arithmetic).

Why: XLA's float32 pow is exp(e * log(b)) to within some ulps on a CPU, 10-80 ulps on a TPU, and
optimizers subtract such powers from 1 (Adam's bias correction 1 - beta**t, RAdam's
rho_t = rho_inf - 2 t beta**t / (1 - beta**t)), which multiplies the error by 1 / (1 - beta**t):
a thousand for beta = 0.999 in the first steps. Here no transcendental function is used, so the
result is the same on every platform.

How: the base is a Python number, so its double value is known when the program is built.
|base|**(2**k) and |base|**-(2**k) for every bit k of the exponent are computed on the host to
128 bits (Python integers) and stored as float32 pairs ``(hi + lo) * 2**n`` with hi in [1, 2]:
128-bit powers are far beyond what float32 needs, and the separate power of two ``n`` keeps
the pairs and the running product clear of float32's overflow and underflow whatever the base.
The device multiplies the pairs of the exponent's set bits (selecting the reciprocal table for
negative exponents: no division on the device), each product a float-float multiplication
built on Dekker's exact product, and finally scales by 2**N.

Error: each float-float product is within ~5 * 2**-48 of the exact one (Dekker's product is
exact; the cross terms and the tables' lo parts are rounded), at most 24 of them within 2**-41,
so the float32 result ``hi`` (= round(hi + lo)) is the correctly rounded power unless the exact
one lies within 2**-41 (relative) of a midpoint between two float32 numbers: at most 0.5 ulp +
2**-17 ulp. Measured against float64 over exponents 1..2000 and beyond, on the CPU client and
on a TPU v5e alike: no result off by more than half an ulp (XLA's pow on the v5e: 40-130 ulps).
Subnormal results are flushed to zero, as XLA's float arithmetic does on the CPU and the TPU.

The base is taken at its double value, as Python arithmetic on a Python step count (eager
torch.optim) has it: PyTorch's own pow rounds the base to float32 first, which for 0.999 moves
0.999**t by t * 1.3e-8 relative (1 ulp at t = 2, 130 ulps at t = 1000).
"""

from __future__ import annotations

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Bits of |exponent| read: every whole float32 number up to 2**24 (above which float32 can no
# longer count by one; a float32 step count stops at 2**24).
EXPONENT_BITS = 25
MAX_EXPONENT = 2 ** (EXPONENT_BITS - 1)
_HOST_BITS = 128  # precision of the host's powers: 25 squarings lose 25 bits of it at most
# |n| of one table entry past which the power is 0 or inf anyway in float32: clamped so that
# the sum of 25 of them stays within int32.
_MAX_TABLE_SHIFT = 1000
_MAX_SHIFT = 200  # |N| of a result past which hi * 2**N (hi in [1, 2**25]) is 0 or inf


def is_host_base(base) -> bool:
    """A Python number whose float32 value is a normal number: the bases this module takes
    (0, subnormals, inf and nan keep IEEE pow's special cases)."""
    if isinstance(base, bool) or not isinstance(base, (int, float)):
        return False
    try:
        with np.errstate(over="ignore"):
            magnitude = abs(float(np.float32(float(base))))
    except OverflowError:  # an int beyond double's range
        return False
    return bool(np.isfinite(magnitude)) and magnitude >= np.finfo(np.float32).tiny


# ----------------------------------------------------------------------------- host tables


def _round_to_host_bits(mantissa: int, exponent: int) -> tuple[int, int]:
    excess = mantissa.bit_length() - _HOST_BITS
    if excess > 0:
        mantissa = (mantissa + (1 << (excess - 1))) >> excess
        exponent += excess
    return mantissa, exponent


def _host_split(hi: np.float32) -> tuple[float, float]:
    """:func:`_split` of a float32 number on the host."""
    bits = np.array([hi], np.float32).view(np.int32)
    big = ((bits + 0x800) & ~0xFFF).astype(np.int32).view(np.float32)[0]
    return float(big), float(np.float32(hi - big))


def _entry(mantissa: int, exponent: int) -> tuple:
    """mantissa * 2**exponent as float32 (hi, hi_big, hi_small, lo) and int n, value
    = (hi + lo) * 2**n with hi in [1, 2]."""
    top = mantissa.bit_length() - 1
    shift = int(np.clip(exponent + top, -_MAX_TABLE_SHIFT, _MAX_TABLE_SHIFT))
    fraction = Fraction(mantissa, 1 << top)  # in [1, 2)
    hi = np.float32(float(fraction))
    lo = np.float32(float(fraction - Fraction(float(hi))))
    big, small = _host_split(hi)
    return float(hi), big, small, float(lo), shift


def _host_table(base: float) -> list[tuple[tuple, tuple]]:
    """For each bit k: the entries of |base|**(2**k) and |base|**-(2**k)."""
    numerator, denominator = abs(float(base)).as_integer_ratio()
    mantissa, exponent = numerator, 1 - denominator.bit_length()
    table = []
    for _ in range(EXPONENT_BITS):
        reciprocal_shift = 2 * _HOST_BITS  # 2**256 / mantissa: at least 128 bits
        reciprocal = ((1 << reciprocal_shift) + mantissa // 2) // mantissa
        table.append((_entry(mantissa, exponent),
                      _entry(reciprocal, -reciprocal_shift - exponent)))
        mantissa, exponent = _round_to_host_bits(mantissa * mantissa, 2 * exponent)
    return table


# ----------------------------------------------------------------------------- device


def _split(x):
    """x = big + small, big holding x's leading 12 bits (rounded): a product of two such parts
    has at most 24 bits, so it is exact in float32 (Dekker's condition). Done on the integer
    bits rather than Veltkamp's c - (c - x), which an algebraic simplifier could fold to x."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    big = lax.bitcast_convert_type((bits + 0x800) & ~0xFFF, jnp.float32)
    return big, x - big


def _times_entry(hi, lo, entry):
    """(hi + lo) * (entry's hi + lo) as a normalised float-float pair (Dekker's product; the
    dropped lo * lo is 2**-48 of the result)."""
    e_hi, e_big, e_small, e_lo = entry
    product = hi * e_hi
    big, small = _split(hi)
    error = ((big * e_big - product) + big * e_small + small * e_big) + small * e_small
    error = error + (hi * e_lo + lo * e_hi)
    head = product + error
    return head, error - (head - product)  # Fast2Sum: |product| >= |error|


def _power_of_two(n):
    """2.0**n as float32 for int32 n in [-126, 127]."""
    return lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


def scale(value, shift):
    """value * 2**shift, rounded once, for |value| in [2**-26, 2**26] and any int32 shift."""
    shift = jnp.clip(shift, -_MAX_SHIFT, _MAX_SHIFT)
    first = jnp.clip(shift, -100, 100)  # value * 2**first is a normal number: exact
    return value * _power_of_two(first) * _power_of_two(shift - first)


def power_parts(base: float, exponent):
    """|base|**exponent as (hi, lo, shift): (hi + lo) * 2**shift, hi in [1, 2**25], for a
    float32 ``exponent`` array of whole numbers with |exponent| <= MAX_EXPONENT (others: any
    value).

    A loop over the bits, the table an operand: unrolled, XLA's CPU compiler fails on the
    25 chained products for some bases (an "Unknown MLIR failure" for base 2.0)."""
    table = _host_table(base)
    parts = jnp.asarray([[up[:4], down[:4]] for up, down in table], jnp.float32)  # [bit, sign, 4]
    shifts = jnp.asarray([[up[4], down[4]] for up, down in table], jnp.int32)  # [bit, sign]
    count = jnp.abs(exponent).astype(jnp.int32)
    negative = exponent < 0

    def multiply_bit(bit, state):
        hi, lo, shift = state
        entry = [jnp.where(negative, parts[bit, 1, i], parts[bit, 0, i]) for i in range(4)]
        take = ((count >> bit) & 1) == 1
        new_hi, new_lo = _times_entry(hi, lo, entry)
        shift = shift + jnp.where(take, jnp.where(negative, shifts[bit, 1], shifts[bit, 0]), 0)
        return jnp.where(take, new_hi, hi), jnp.where(take, new_lo, lo), shift

    start = (jnp.ones(exponent.shape, jnp.float32), jnp.zeros(exponent.shape, jnp.float32),
             jnp.zeros(exponent.shape, jnp.int32))
    return lax.fori_loop(0, EXPONENT_BITS, multiply_bit, start)


def is_subnormal(x):
    """Which elements of a floating array are subnormal, read from their bits: XLA's float
    comparisons flush subnormals to zero (a TPU's arithmetic too), so ``x != 0`` cannot tell."""
    info = jnp.finfo(x.dtype)
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"int{info.bits}"))
    mantissa_bits = info.nmant
    exponent_field = (bits >> mantissa_bits) & ((1 << (info.bits - 1 - mantissa_bits)) - 1)
    return (exponent_field == 0) & ((bits & ((1 << mantissa_bits) - 1)) != 0)


def ieee_pow(base, exponent):
    """``jnp.power`` with IEEE pow's special cases where a platform's pow (exp(e * log(b)))
    misses them: ``x ** 0`` and ``1 ** y`` are 1 for every x and y, nan included (a TPU gives
    inf ** 0 = nan), and a subnormal exponent, which a TPU's arithmetic flushes to zero, acts
    as the smallest normal number of its sign, which gives IEEE's result for every base
    (0 ** 1e-45 = 0, (-2) ** 1e-45 = nan, inf ** -1e-45 = 0; 1 for other positive bases)."""
    tiny = jnp.asarray(jnp.finfo(exponent.dtype).tiny, exponent.dtype)
    negative = lax.bitcast_convert_type(
        exponent, jnp.dtype(f"int{jnp.finfo(exponent.dtype).bits}")) < 0
    exponent = jnp.where(is_subnormal(exponent), jnp.where(negative, -tiny, tiny), exponent)
    result = jnp.power(base, exponent)
    return jnp.where((exponent == 0) | (base == 1), jnp.ones_like(result), result)


def is_whole(exponent):
    """The elements :func:`power` computes by float-float multiplication. A subnormal exponent
    is not whole, though XLA's comparisons flush it to zero: IEEE pow's (-7)**1e-45 is nan."""
    return ((jnp.floor(exponent) == exponent) & (jnp.abs(exponent) <= MAX_EXPONENT)
            & ~is_subnormal(exponent))


def power(base: float, exponent):
    """``base ** exponent`` for a Python number ``base`` (:func:`is_host_base`) and a float32
    array ``exponent``: float-float for whole exponents up to 2**24, IEEE pow otherwise.

    A nested program, one per base: a traced optimizer raises the same beta to a step count
    once per parameter, and tracing the loop over the exponent's bits costs ~10 ms on the host
    each time; JAX keeps the traced program for later calls of the same base and shape."""
    return _power_program(float(base), exponent)


@functools.partial(jax.jit, static_argnums=0)
def _power_program(base: float, exponent):
    whole = is_whole(exponent)
    whole_exponent = jnp.where(whole, exponent, 0)
    hi, _, shift = power_parts(base, whole_exponent)
    result = scale(hi, shift)
    if base < 0:
        odd = (jnp.abs(whole_exponent).astype(jnp.int32) & 1) == 1
        result = jnp.where(odd, -result, result)
    return jnp.where(whole, result, ieee_pow(jnp.float32(base), exponent))
