"""``number ** tensor`` (aten.pow.Scalar) against float64 NumPy and PyTorch on CPU.

Whole exponents are computed by float-float multiplication (tpu_train/ops/scalar_power.py), to
be correctly rounded from the base's double value: the bound asserted is 0.5 ulp + 2**-16 ulp,
the float32 rounding of a float-float product of at most 24 factors, each within ~5 * 2**-48
of the exact one (so within 2**-41 in all, 2**-17 ulp). Results XLA flushes (subnormals) and
overflows are checked apart.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tpu_train
from tests.tolerances import elementwise_rtol, function_ulps
from tpu_train.ops import scalar_power

DEVICE = tpu_train.device(0)
BOUND_ULPS = 0.5 + 2.0 ** -16
TINY = float(np.finfo(np.float32).tiny)
HUGE = float(np.finfo(np.float32).max)
# A non-whole exponent is the platform's pow (exp(e * log(b))): its measured accuracy against
# torch's (tests/measured_ulps; 76 ulps on a TPU v5e, 2 on the CPU client).
POW_RTOL = elementwise_rtol(torch.float32, function_ulps("pow"))

BASES = [0.999, 0.9, 0.95, 0.9999, 1.0001, 2.0, -0.5, 1e-3, 10.0, -1.1, 0.9999999, 1.0, -1.0]
WHOLE = sorted({*range(0, 51), 100, 1000, 2000, 12345, 10**5, 2**23 - 1, 2**23, 2**24 - 1,
                2**24} | {-e for e in (*range(1, 51), 1000, 10**5, 2**23, 2**24)})


def device_pow(base, exponents) -> np.ndarray:
    """``base ** exponents`` computed on the tpu device (eager), as a float32 NumPy array."""
    exponent = torch.tensor(exponents, dtype=torch.float32).to(DEVICE)
    return (base ** exponent).cpu().numpy()


def ulps(got: float, exact: float) -> float:
    """|got - exact| in units of float32's spacing at ``exact`` (a normal number)."""
    _, exponent = math.frexp(exact)
    return abs(got - exact) / math.ldexp(1.0, exponent - 24)


@pytest.mark.parametrize("base", BASES)
def test_whole_exponents_are_correctly_rounded(base):
    got = device_pow(base, WHOLE)
    worst = 0.0
    for e, value in zip(WHOLE, got.tolist()):
        with np.errstate(over="ignore"):
            exact = float(np.power(np.float64(base), np.float64(e)))
        if abs(exact) >= HUGE * (1 + 2.0 ** -25):  # rounds to inf
            assert value == math.copysign(math.inf, exact), (e, value, exact)
        elif abs(exact) < TINY:  # subnormal or below: flushed to (signed) zero, or within one
            # unit of the subnormal spacing (one more rounding) where a platform keeps them
            assert value == 0 or abs(value - exact) <= 2.0 ** -149, (e, value, exact)
        else:
            err = ulps(value, exact)
            worst = max(worst, err)
            assert err <= BOUND_ULPS, (e, value, exact, err)
    assert worst <= BOUND_ULPS


def test_correct_rounding_over_many_steps():
    """Exponents 1..4000 for Adam/RAdam's betas: the rounding of the exact power each time
    (a miss would take an exact power within 2**-41 of a midpoint: none here), down to
    float32's smallest normal number."""
    exponents = list(range(1, 4001))
    for base in (0.9, 0.95, 0.99, 0.999, 0.9999):
        got = device_pow(base, exponents).astype(np.float64)
        exact = np.power(np.float64(base), np.arange(1, 4001, dtype=np.float64))
        normal = exact >= TINY
        np.testing.assert_array_equal(got[normal], exact[normal].astype(np.float32))


def test_non_whole_exponents_fall_back_to_pow():
    exponents = [0.5, -0.5, 2.5, -1.25, 1e-3, 7.75, 1e-30]
    for base in (0.999, 2.0, 10.0, 0.5):
        got = device_pow(base, exponents)
        expected = torch.pow(base, torch.tensor(exponents)).numpy()
        np.testing.assert_allclose(got, expected, rtol=POW_RTOL)
    # a negative base to a fraction: nan, as in PyTorch
    assert np.isnan(device_pow(-0.5, [0.5, -2.5])).all()


# Bases exact in float32 (PyTorch rounds the base to float32 first, this lowering takes its
# double value: for these both agree), with IEEE pow's special cases; subnormal bases are left
# out, since XLA flushes them to zero on the CPU and TPU alike.
SPECIAL_BASES = [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 0.5, -0.5, 2.0, -2.0,
                 3.0, -3.0, 2.0 ** -100, 2.0 ** 100, -(2.0 ** 100), HUGE, 1e39, -1e39, 7, -7]
SPECIAL_EXPONENTS = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 0.5, -0.5, 1.5, math.inf,
                     -math.inf, math.nan, 2.0 ** 24, -(2.0 ** 24), 2.0 ** 24 + 2, 1e10, -1e10,
                     127.0, 128.0, -126.0, -127.0, -149.0, -150.0, 1e-45]


@pytest.mark.parametrize("base", SPECIAL_BASES, ids=repr)
def test_special_values_match_pytorch(base):
    got = device_pow(base, SPECIAL_EXPONENTS)
    expected = torch.pow(base, torch.tensor(SPECIAL_EXPONENTS)).numpy()
    for e, g, x in zip(SPECIAL_EXPONENTS, got.tolist(), expected.tolist()):
        if x != 0 and abs(x) < TINY:  # PyTorch's subnormal result, flushed here
            assert g == 0 or g == x, (base, e, g, x)
            continue
        if math.isfinite(e) and not float(e).is_integer() and math.isfinite(x) and x != 0:
            # the platform's pow (IEEE's special cases are exact: 0, inf, nan, 1 below)
            assert abs(g - x) <= POW_RTOL * abs(x), (base, e, g, x)
        else:
            assert (math.isnan(g) and math.isnan(x)) or g == x, (base, e, g, x)
        assert math.copysign(1, g) == math.copysign(1, x) or math.isnan(x), (base, e, g, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64])
def test_other_exponent_dtypes(dtype):
    exponents = torch.arange(0, 40).to(dtype)
    got = (0.999 ** exponents.to(DEVICE)).cpu()
    expected = torch.from_numpy(np.power(0.999, exponents.double().numpy())).to(got.dtype)
    assert got.dtype == torch.pow(0.999, exponents).dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_foreach_pow_scalar_and_tensor():
    steps = [torch.tensor(float(t)) for t in (1, 5, 1000)]
    got = torch._foreach_pow(0.999, [s.to(DEVICE) for s in steps])
    for g, s in zip(got, steps):
        assert g.cpu().item() == np.float32(0.999 ** s.item())


def test_radam_rectification_switches_on_at_step_6():
    """RAdam's rho_t = rho_inf - 2 t b**t / (1 - b**t) as its capturable/compiled path computes
    it (float32 tensors on the device): b = 0.999 gives rho_5 = 4.996 (threshold 5), so the
    power must be within the float32 rounding. Each rho_t is within what rounding b**t to
    float32 allows, 2 t 2**-25 / (1 - b**t)**2, plus rho_inf's spacing (2**-13)."""
    beta2 = 0.999
    rho_inf = 2 / (1 - beta2) - 1
    for t in range(1, 11):
        step = torch.tensor(float(t)).to(DEVICE)
        power = beta2 ** step
        rho = float((rho_inf - 2 * step * power / (1 - power)).cpu())
        exact = rho_inf - 2 * t * beta2 ** t / (1 - beta2 ** t)
        assert (rho > 5) == (exact > 5), (t, rho, exact)
        bound = 2 * t * 2.0 ** -25 / (1 - beta2 ** t) ** 2 * 1.01 + 2.0 ** -13
        assert abs(rho - exact) <= bound, (t, rho, exact, bound)


def test_host_table_is_exact_for_powers_of_two():
    table = scalar_power._host_table(0.5)
    for k, (up, down) in enumerate(table):
        assert up[0] == down[0] == 1.0 and up[3] == down[3] == 0.0
        assert up[4] == max(-(2 ** k), -1000) and down[4] == min(2 ** k, 1000)


def test_tensor_to_tensor_power_keeps_ieee_special_cases():
    """``tensor ** tensor``: x ** 0 and 1 ** y are 1 for every x and y, and a subnormal
    exponent gives IEEE's result, though a TPU's pow gives inf ** 0 = nan and its arithmetic
    flushes subnormal operands (the exponent then acted as 0: 0 ** 1e-45 = 1)."""
    bases = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, -2.0, 2.0, 1.0, -1.0, 1e30])
    exponents = torch.tensor([0.0, -0.0, 1e-45, -1e-45, math.nan, 3.0])
    b, e = torch.broadcast_tensors(bases[:, None], exponents[None, :])
    got = torch.pow(b.to(DEVICE), e.to(DEVICE)).cpu()
    torch.testing.assert_close(got, torch.pow(b, e), rtol=0, atol=0, equal_nan=True)


def test_a_base_is_traced_once_however_many_exponents_it_meets(monkeypatch):
    """A traced optimizer raises one beta to a step count per parameter: the loop over the
    exponent's bits is traced once per base and shape, not once per call."""
    import jax
    import jax.numpy as jnp

    tables = []
    real_table = scalar_power._host_table
    monkeypatch.setattr(scalar_power, "_host_table", lambda base: tables.append(base)
                        or real_table(base))
    base = 0.987654  # a base no other test of this session traces

    def corrections(step):
        return [1 - scalar_power.power(base, step) for _ in range(6)]

    step = jnp.float32(7.0)
    values = jax.jit(corrections)(step)
    assert tables == [base]
    exact = 1 - float(np.float32(base ** 7))
    assert all(float(v) == pytest.approx(exact, rel=1e-6) for v in values)
