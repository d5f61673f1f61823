"""Bessel J/Y, modified Bessel K and Airy Ai lowerings (tpu_train/ops/bessel.py).

Accuracy is checked against PyTorch's float64 kernels (float32 results, so a few float32 ulps
of ``1 + |f|``, the atol = rtol convention of tests/tolerances.py); domain edges, dtypes and
the float32 kernels are checked against CPU PyTorch directly.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches, run_lowering
from tests.platforms import PLATFORM
from tests.tolerances import function_ulps
from tpu_train.ops import bessel  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten

ULP = 2.0 ** -24
# Measured largest errors against the float64 kernels on these ranges on the CPU client: 2.9 ..
# 13 ulps (the series' own error and the CPU's log / exp / I_n, a few ulps each).
ULPS = 16
# ATen's Airy kernel, in double precision too, is ~40 float32 ulps off just below x = -2.09
# where it switches to its asymptotic form; the lowering is accurate there (scipy agrees).
AIRY_ULPS = 48

CASES = [
    ("bessel_j0", -30, 30), ("bessel_j1", -30, 30), ("bessel_y0", 1e-3, 30),
    ("bessel_y1", 0.05, 30), ("modified_bessel_k0", 1e-3, 20), ("modified_bessel_k1", 0.05, 20),
    ("scaled_modified_bessel_k0", 1e-3, 60), ("scaled_modified_bessel_k1", 0.05, 60),
    ("airy_ai", -10, 10),
]


def _op(name):
    return getattr(aten, f"special_{name}").default


def _excess(function: str) -> float:
    """How many more ulps than the CPU client's the test platform's ``function`` measures
    against torch (tests/measured_ulps): 0 on the CPU client."""
    return max(0.0, function_ulps(function, PLATFORM) - function_ulps(function, "cpu"))


def _function_terms(name, x):
    """``{function: a(x)}``: the lowering's error in ``name`` at float64 points ``x``, in ulps
    of ``1 + |f(x)|``, per ulp of each function it calls (as measured: ulps of ``1 + |g|``),
    from its formulas (tpu_train/ops/bessel.py). Y_n (x <= 8): ``(2/pi) log(x) J_n(x)``.
    K_n (x <= 2): ``e^-x (e^x (series -+ log(x/2) I_n(x)))``: log's error times I_n, I_n's
    times |log(x/2)|, and each exp's relative error; beyond 2, one exp. The scaled forms
    multiply the x <= 2 branch by e^x: an absolute error near log's zero (x = 2) times
    e^2 I_0(2) = 17."""
    f = _op(name)(x).abs()
    small = (x <= 2).double()
    if name in ("bessel_y0", "bessel_y1"):
        j = (torch.special.bessel_j0 if name == "bessel_y0" else torch.special.bessel_j1)(x)
        terms = {"log": (x <= 8).double() * (2 / math.pi) * j.abs() * (1 + x.log().abs())}
    else:
        order = name[-1]
        i_n = (torch.special.i0 if order == "0" else torch.special.i1)(x)
        log_half = (x / 2).log().abs()
        scaled = name.startswith("scaled")
        grow = torch.where(small.bool(), x.exp(), 1.0) if scaled else 1.0
        terms = {"log": small * grow * i_n * (1 + log_half),
                 "i0" if order == "0" else "special_i1": small * grow * log_half * (1 + i_n),
                 "exp": f * (small if scaled else 1 + small)}
    return {g: a / (1 + f) for g, a in terms.items()}


@functools.cache
def allowed_ulps(name: str) -> float:
    """ULPS, plus where the test platform's functions are less accurate than the CPU's (a TPU:
    log 1370 ulps against 1.6) their excess times what the formula does with it, at its worst
    over the accuracy grid: derived from tests/measured_ulps, ULPS itself on the CPU client."""
    if name in ("bessel_j0", "bessel_j1", "airy_ai"):
        return ULPS  # arithmetic, sqrt, sin and cos: within an ulp of the CPU's everywhere
    low, high = next((lo, hi) for n, lo, hi in CASES if n == name)
    x = torch.linspace(low, high, 30001, dtype=torch.float64)
    terms = _function_terms(name, x)
    return ULPS + max(sum(_excess(g) * a for g, a in terms.items())).item()


@pytest.mark.parametrize("name, low, high", CASES, ids=[c[0] for c in CASES])
def test_accuracy_against_float64(name, low, high):
    op = _op(name)
    # Both sides of every split point (8, 2, -4, and ATen's 5 and -2.09) lie in these grids.
    x = torch.linspace(low, high, 30001)
    got, _ = run_lowering(op, x)
    ref = op(x.double())
    ulps = ((got.double() - ref).abs() / (ULP * (1 + ref.abs()))).max().item()
    allowed = AIRY_ULPS if name == "airy_ai" else allowed_ulps(name)
    assert ulps <= allowed, f"{name}: {ulps:.1f} ulps"


EDGES = torch.tensor([float("-inf"), -3.0, -1e-30, -0.0, 0.0, 1e-30, 1e-6, 0.5, 2.0, 7.99, 8.0,
                      8.01, 30.0, 90.0, 200.0, 1e4, float("inf"), float("nan")])


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_edges_match_torch(name):
    # inf / NaN / signed zeros and points where the working precision's exp under- or
    # overflows. 1e4 is far out on the oscillating asymptotics (phase rounded as ATen does).
    assert_lowering_matches(_op(name), EDGES, atol=1e-6, rtol=4 * allowed_ulps(name) * ULP)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float64])
def test_dtypes(dtype):
    # CPU PyTorch has no 16-bit float kernels for these; integers and bool compute in float32.
    x = torch.tensor([1, 2, 3, 7, 9, 12]).to(dtype)
    for name, _, _ in CASES:
        got, want = run_lowering(_op(name), x)
        assert got.dtype == want.dtype
        tol = 1e-6 * allowed_ulps(name) / ULPS  # 1e-6 (~16 ulps) on the CPU client
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=name)
