"""Element-wise arithmetic and math lowerings against PyTorch on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tests.ops.lowering_check import assert_lowering_matches, default_tolerance, to_jax, to_torch
from tests.tolerances import ELEMENTWISE_ULPS, elementwise_rtol
from tpu_train.ops import comparison, pointwise  # noqa: F401  (registers the lowerings)
from tpu_train.ops.float_remainder import fmod_by_exact_steps
from tpu_train.ops.registry import aten, get_lowering

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
INTS = [torch.int64, torch.int32, torch.int8, torch.uint8]


def tolerance(dtype, ulps="transcendental", roundings=1, scale=1.0):
    """assert_close's (atol, rtol) for an elementwise op with no reduction on ``dtype``
    (tests/tolerances.py ``elementwise_rtol``): ``ulps`` the function's accuracy in u (a key of
    ELEMENTWISE_ULPS, or the number of correctly rounded operations of a composite),
    ``roundings`` how many times a 16-bit result may be rounded to the dtype. atol is rtol at
    ``scale``, the size of the inputs / intermediates, for outputs that cancel to near zero.
    Integer (and bool) results are exact."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return dict(atol=0, rtol=0)
    rtol = elementwise_rtol(dtype, ulps, roundings)
    return dict(atol=rtol * scale, rtol=rtol)


def make(shape, dtype, low=-4.0, high=4.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=generator) * (high - low) + low).to(dtype)
    low = max(int(low), 0) if dtype == torch.uint8 else int(low)
    return torch.randint(low, int(high) + 1, shape, generator=generator).to(dtype)


def assert_matches_jitted(op, *args, atol=None, rtol=None, **kwargs):
    """Run the lowering inside ``jax.jit`` with every float argument traced, as the compiled
    step and eager mode do, and compare with PyTorch."""
    expected = op(*args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    dynamic = [i for i, v in enumerate(leaves)
               if isinstance(v, torch.Tensor) or (isinstance(v, float))]

    def run(*traced):
        filled = list(leaves)
        for i, value in zip(dynamic, traced):
            filled[i] = value
        call_args, call_kwargs = tree_unflatten(filled, spec)
        return get_lowering(op).fn(*call_args, **call_kwargs)

    inputs = [to_jax(leaves[i]) if isinstance(leaves[i], torch.Tensor)
              else jnp.asarray(leaves[i], jnp.float32) for i in dynamic]
    got = jax.jit(run)(*inputs)
    if isinstance(expected, torch.Tensor):
        got, expected = [got], [expected]
    for g, e in zip(got, expected):
        g = to_torch(g, e.dtype)
        assert g.shape == e.shape
        default = default_tolerance(e.dtype)  # as assert_lowering_matches
        torch.testing.assert_close(g, e, atol=default if atol is None else atol,
                                   rtol=default if rtol is None else rtol, equal_nan=True)


FLOAT_UNARY = [aten.exp, aten.exp2, aten.expm1, aten.log, aten.log2, aten.log10, aten.log1p,
               aten.sqrt, aten.rsqrt, aten.reciprocal, aten.sin, aten.cos, aten.tan, aten.asin,
               aten.acos, aten.atan, aten.sinh, aten.cosh, aten.tanh, aten.asinh, aten.acosh,
               aten.atanh, aten.erf, aten.erfc, aten.erfinv, aten.sigmoid, aten.lgamma,
               aten.digamma, aten.i0, aten.sinc, aten.deg2rad, aten.rad2deg]
# Inputs inside each function's domain, plus its edges (0, ±1, inf, nan) in a second case.
SPECIAL_VALUES = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, float("inf"), -float("inf"),
                               float("nan"), 1e-30, 30.0])


@pytest.mark.parametrize("packet", FLOAT_UNARY, ids=lambda p: p.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_float_unary(packet, dtype):
    low, high = (-0.9, 0.9) if packet in (aten.asin, aten.acos, aten.atanh, aten.erfinv) else (
        (1.1, 5.0) if packet == aten.acosh else (-3.0, 3.0))
    x = make((5, 7), dtype, low, high)
    # One function of the measured accuracy (ELEMENTWISE_ULPS), atol at the output's scale 1
    # as measured; deg2rad / rad2deg / reciprocal are one correctly rounded multiply / divide,
    # relative, with nothing to cancel (no atol). An integer input gives a float32 result.
    name = packet.__name__
    single = packet in (aten.deg2rad, aten.rad2deg, aten.reciprocal)
    ulps = "arithmetic" if single else (name if name in ELEMENTWISE_ULPS else "transcendental")
    tol = tolerance(torch.float32 if dtype == torch.int64 else dtype, ulps, scale=0 if single else 1)
    if packet in (aten.lgamma, aten.digamma, aten.tan) and dtype == torch.int64:
        x = x.clamp_min(1)
    assert_lowering_matches(packet.default, x, **tol)
    if dtype == torch.float32:
        # Up to 30.0, outside the measured domain: a rounding (u) of the argument inside the
        # function (x * ln 2 for exp2, the range reduction of exp / sinh / cosh) is amplified
        # by the condition number |x f'(x) / f(x)|, 30 * ln 2 .. 30 there: ulps + 30.
        ulps = ELEMENTWISE_ULPS[ulps] if isinstance(ulps, str) else ulps
        assert_lowering_matches(packet.default, SPECIAL_VALUES, **tolerance(dtype, ulps + 30))


SAME_DTYPE_UNARY = [aten.abs, aten.neg, aten.sign, aten.sgn, aten.floor, aten.ceil, aten.round,
                    aten.trunc, aten.frac, aten.signbit, aten.isnan, aten.isinf, aten.isfinite,
                    aten.isposinf, aten.isneginf, aten.nan_to_num]


@pytest.mark.parametrize("packet, dtype", [
    (packet, dtype) for packet in SAME_DTYPE_UNARY
    for dtype in [torch.float32, torch.float16, torch.int64, torch.uint8]
    if dtype.is_floating_point or packet != aten.frac])
def test_same_dtype_unary(packet, dtype):
    if packet == aten.neg and dtype == torch.uint8:
        x = make((4, 6), dtype, 0, 9)
    else:
        x = make((4, 6), dtype)
    if dtype.is_floating_point:
        x = torch.cat([x.flatten(), torch.tensor([0.5, 1.5, 2.5, -2.5, -0.0, float("inf"),
                                                  -float("inf"), float("nan")], dtype=dtype)])
    assert_lowering_matches(packet.default, x)


def test_round_decimals_and_empty_and_zero_dim():
    x = torch.tensor([1.2345, -2.5551, 123.456, 0.125])
    for decimals in (0, 1, 2, -1):
        assert_lowering_matches(aten.round.decimals, x, decimals=decimals)
    assert_lowering_matches(aten.exp.default, torch.empty(0, 3))
    assert_lowering_matches(aten.neg.default, torch.tensor(2.5))


def test_nan_to_num_and_logit_arguments():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.3, 1.0, 0.0])
    assert_lowering_matches(aten.nan_to_num.default, x, 1.0, 2.0, -3.0)
    assert_lowering_matches(aten.nan_to_num.default, x.bfloat16())
    assert_lowering_matches(aten.logit.default, x)
    assert_lowering_matches(aten.logit.default, x, 1e-3)
    assert_matches_jitted(aten.logit.default, x, 1e-3)


BINARY = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.atan2.default,
          aten.maximum.default, aten.minimum.default, aten.fmax.default, aten.fmin.default,
          aten.remainder.Tensor, aten.fmod.Tensor, aten.xlogy.Tensor, aten.copysign.Tensor,
          aten.hypot.default]
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
               (torch.int64, torch.int64), (torch.int32, torch.float32),
               (torch.uint8, torch.int8)]


@pytest.mark.parametrize("op, dtypes", [
    (op, dtypes) for op in BINARY for dtypes in DTYPE_PAIRS
    if op != aten.hypot.default or all(d.is_floating_point for d in dtypes)])
def test_binary_broadcasting(op, dtypes):
    a = make((3, 1, 5), dtypes[0], seed=1)
    b = make((4, 1), dtypes[1], 1, 5, seed=2)
    # One transcendental function (atan2, xlogy, hypot) or a few correctly rounded operations
    # (remainder: a - floor(a / b) * b, which cancels: atol at the inputs' size, 5).
    tol = tolerance(op(a, b).dtype, "transcendental", scale=5)
    assert_lowering_matches(op, a, b, **tol)
    # A 0-dim tensor takes part in promotion only through its category.
    zero_dim = make((), torch.float64 if dtypes[0].is_floating_point else torch.int64, 1, 3)
    assert_lowering_matches(op, a, zero_dim, **tol)


def test_binary_nan_and_special_values():
    a = torch.tensor([float("nan"), 1.0, -0.0, 0.0, float("inf"), 2.0])
    b = torch.tensor([1.0, float("nan"), 0.0, -0.0, 1.0, float("inf")])
    for op in (aten.maximum.default, aten.minimum.default, aten.fmax.default,
               aten.fmin.default, aten.xlogy.Tensor, aten.remainder.Tensor, aten.fmod.Tensor):
        assert_lowering_matches(op, a, b)
    assert_lowering_matches(aten.xlogy.Tensor, torch.tensor([0.0, 0.0, 1.0]),
                            torch.tensor([0.0, float("nan"), 0.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int8])
@pytest.mark.parametrize("mode", [None, "trunc", "floor"])
def test_div_rounding_modes(dtype, mode):
    a = make((6, 8), dtype, -20, 20, seed=3)
    b = make((6, 8), dtype, -6, 6, seed=4)
    b = torch.where(b == 0, torch.ones_like(b), b)
    # A division, or a multiplication by the reciprocal (two roundings), then trunc / floor;
    # the result's dtype (float for an integer true division).
    def check(op, *args, **kwargs):
        assert_lowering_matches(op, *args, **kwargs, **tolerance(op(*args, **kwargs).dtype, 2))

    check(aten.div.Tensor_mode, a, b, rounding_mode=mode)
    check(aten.div.Scalar_mode, a, -3, rounding_mode=mode)
    if dtype.is_floating_point:
        check(aten.div.Scalar_mode, a, 0.7, rounding_mode=mode)


def test_float_floor_division_edge_cases():
    a = torch.tensor([5.0, -5.0, 5.0, -5.0, 0.0, -0.0, 1.0, 7.5, 1e10, 3.0])
    b = torch.tensor([3.0, 3.0, -3.0, -3.0, 2.0, 2.0, 0.0, 2.5, 3.0, -0.0])
    assert_lowering_matches(aten.div.Tensor_mode, a, b, rounding_mode="floor")
    assert_lowering_matches(aten.remainder.Tensor, a, b)
    assert_lowering_matches(aten.fmod.Tensor, a, b)


def test_fmod_by_exact_steps_is_c_fmod():
    """The exact steps a TPU's fmod takes (float_remainder) against C's fmodf (NumPy's float32
    fmod), bit for bit, over quotients of up to 2^100 and the special values; results below
    float32's smallest normal are left out (a TPU flushes them to zero)."""
    rng = np.random.default_rng(0)
    magnitudes = rng.standard_normal(400) * 10.0 ** rng.integers(-15, 16, 400)
    values = np.concatenate([magnitudes, [0.0, -0.0, np.inf, -np.inf, np.nan, 1e10, 3.0, -5.0,
                                          2.5, 7.5, 3.4e38, 1.2e-30]]).astype(np.float32)
    a, b = (v.reshape(-1) for v in np.meshgrid(values, values))
    got = np.asarray(jax.jit(fmod_by_exact_steps)(a, b))
    with np.errstate(invalid="ignore"):
        want = np.fmod(a, b)
    normal = (want == 0) | ~np.isfinite(want) | (np.abs(want) >= np.finfo(np.float32).tiny)
    assert normal.mean() > 0.99
    np.testing.assert_array_equal(got[normal], want[normal])
    assert (np.signbit(got) == np.signbit(want))[normal & ~np.isnan(want)].all()
    assert np.asarray(jax.jit(fmod_by_exact_steps)(np.float32(1e10), np.float32(3.0))) == 1.0
    grads = jax.grad(lambda a, b: fmod_by_exact_steps(a, b).sum(), argnums=(0, 1))(
        jnp.array([7.5, -5.0]), jnp.array([2.0, 3.0]))
    assert [g.tolist() for g in grads] == [[1.0, 1.0], [-3.0, 1.0]]  # torch's: 1, -trunc(a/b)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8])
def test_integer_remainder_signs(dtype):
    a = torch.tensor([7, -7, 7, -7, 0, 6], dtype=dtype)
    b = torch.tensor([3, 3, -3, -3, 5, -3], dtype=dtype)
    for op in (aten.remainder.Tensor, aten.fmod.Tensor, aten.floor_divide.default):
        assert_lowering_matches(op, a, b)
    assert_lowering_matches(aten.remainder.Scalar, a, -4)
    assert_lowering_matches(aten.remainder.Scalar_Tensor, 9, b)


@pytest.mark.parametrize("dtype", FLOATS + [torch.int64])
def test_scalar_arithmetic_and_alpha(dtype):
    x = make((3, 4), dtype)
    # x + alpha * y: two correctly rounded operations (or one fma), inputs of size 4 that
    # may cancel (atol at that size).
    tol = tolerance(dtype, 2, roundings=2, scale=4)
    for op in (aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar,
               aten.rsub.Scalar):
        assert_lowering_matches(op, x, 2, **tol)
        assert_lowering_matches(op, x, 2.5, **tol)
    y = make((4,), dtype, seed=5)
    assert_lowering_matches(aten.add.Tensor, x, y, alpha=3, **tol)
    assert_lowering_matches(aten.sub.Tensor, x, y, alpha=2, **tol)
    assert_lowering_matches(aten.rsub.Tensor, x, y, alpha=2, **tol)
    if dtype.is_floating_point:
        assert_matches_jitted(aten.add.Tensor, x, y, alpha=0.3, **tol)
        assert_matches_jitted(aten.mul.Scalar, x, 0.1, **tol)


def test_bool_arithmetic():
    a, b = make((8,), torch.bool, seed=1), make((8,), torch.bool, seed=2)
    assert_lowering_matches(aten.add.Tensor, a, b)
    assert_lowering_matches(aten.mul.Tensor, a, b)
    assert_lowering_matches(aten.add.Scalar, a, 3)
    assert_lowering_matches(aten.div.Tensor, a, b.logical_not())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32])
def test_pow(dtype):
    base = make((4, 5), dtype, -3, 3, seed=6)
    exponent = make((4, 5), dtype, 0, 3, seed=7)
    # pow: one function of the result's dtype (integer results exact)
    def check(op, *args):
        assert_lowering_matches(op, *args, **tolerance(op(*args).dtype, "transcendental"))

    check(aten.pow.Tensor_Tensor, base, exponent)
    for scalar in (2, 3, 0, 0.5, -1.5) if dtype.is_floating_point else (2, 3, 0, 2.5):
        check(aten.pow.Tensor_Scalar, base.abs() if isinstance(scalar, float) else base, scalar)
    check(aten.pow.Scalar, 2, exponent)
    check(aten.pow.Scalar, 1.5, exponent)


def test_integer_pow_negative_exponent():
    base = torch.tensor([1, -1, -1, 2, 0, 3, -2])
    exponent = torch.tensor([-3, -2, -3, -1, 2, 0, 3])
    assert_lowering_matches(aten.pow.Tensor_Tensor, base, exponent)


def test_pow_traced_exponent():
    assert_matches_jitted(aten.pow.Tensor_Scalar, torch.rand(5) + 0.5, 0.7)


@pytest.mark.parametrize("dtype", FLOATS)
def test_lerp_addcmul_addcdiv(dtype):
    a, b, c = (make((3, 4), dtype, seed=s) for s in (1, 2, 3))
    weight = torch.rand(3, 4).to(dtype)
    # a + w * (b - a), a + v * b * c, a + v * b / c: three correctly rounded operations (16-bit:
    # possibly rounded to the dtype after each), intermediates up to 8 that may cancel.
    tol = tolerance(dtype, 3, roundings=3, scale=8)
    for w in (0.25, 0.75, 1.0):
        assert_lowering_matches(aten.lerp.Scalar, a, b, w, **tol)
    assert_lowering_matches(aten.lerp.Tensor, a, b, weight, **tol)
    assert_lowering_matches(aten.addcmul.default, a, b, c, value=0.5, **tol)
    assert_lowering_matches(aten.addcdiv.default, a, b, c.abs() + 1, value=-2, **tol)
    assert_matches_jitted(aten.addcdiv.default, a, b, c.abs() + 1, value=0.3, **tol)
    assert_matches_jitted(aten.lerp.Scalar, a, b, 0.8, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_clamp(dtype):
    x = make((5, 6), dtype, -10, 10)
    if dtype.is_floating_point:
        x[0, 0] = float("nan")
    tol = dict(atol=0, rtol=0)  # a selection between representable values: exact
    assert_lowering_matches(aten.clamp.default, x, -2, 3, **tol)
    assert_lowering_matches(aten.clamp.default, x, None, 3, **tol)
    assert_lowering_matches(aten.clamp.default, x, 1.5, None, **tol)
    assert_lowering_matches(aten.clamp.default, x, 4, 2, **tol)  # min > max
    low, high = make((6,), dtype, -5, 0, seed=2), make((5, 1), dtype, 0, 5, seed=3)
    assert_lowering_matches(aten.clamp.Tensor, x, low, high, **tol)
    assert_lowering_matches(aten.clamp.Tensor, x, None, high, **tol)
    assert_lowering_matches(aten.clamp_min.default, x, 0, **tol)
    assert_lowering_matches(aten.clamp_max.default, x, 0.5, **tol)
    assert_lowering_matches(aten.clamp_min.Tensor, x, low, **tol)
    assert_lowering_matches(aten.clamp_max.Tensor, x, high, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_products_are_pytorchs_bits(dtype):
    """Two 16-bit tensors multiply in their own dtype (their product is exact in float32, so
    one rounding gives opmath's result): the same bits as PyTorch on the CPU, specials too."""
    a = torch.cat([make((64,), dtype, -300, 300), torch.tensor(
        [0.0, -0.0, float("inf"), float("nan"), 1e-7, 6e4, -6e4]).to(dtype)])
    b = torch.cat([make((64,), dtype, -300, 300, seed=1), torch.tensor(
        [float("inf"), 5.0, 0.0, 1.0, 1e-7, 6e4, 2.0]).to(dtype)])
    assert_matches_jitted(aten.mul.Tensor, a, b, atol=0, rtol=0)
