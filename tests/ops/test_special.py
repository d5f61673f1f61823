"""Special-function lowerings against PyTorch on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches, run_lowering
from tests.tolerances import elementwise_rtol
from tpu_train.ops import special  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten


def tolerance(function):
    """assert_close's atol = rtol for a float32 special function of the measured accuracy
    ELEMENTWISE_ULPS[function] (tests/tolerances.py; measured by scripts/measure_ulps.py
    --special as |xla - torch| / (u (1 + |torch|)), which atol = rtol checks)."""
    rtol = elementwise_rtol(torch.float32, function)
    return dict(atol=rtol, rtol=rtol)


def _x(low=-5.0, high=5.0, n=64):
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, generator=g) * (high - low) + low


@pytest.mark.parametrize("op, low, high", [
    (aten.special_erfcx.default, -3, 10), (aten.special_i0e.default, -10, 10),
    (aten.special_i1.default, -8, 8), (aten.special_i1e.default, -10, 10),
    (aten.special_ndtri.default, 0.01, 0.99), (aten.special_log_ndtr.default, -10, 5),
    (aten.special_modified_bessel_i0.default, -8, 8),
    (aten.special_modified_bessel_i1.default, -8, 8),
    (aten.special_spherical_bessel_j0.default, -20, 20),
])
def test_unary(op, low, high):
    # One special function of the measured accuracy (modified_bessel_i1 has its own figure).
    function = "modified_bessel_i1" if op is aten.special_modified_bessel_i1.default else "special"
    assert_lowering_matches(op, _x(low, high), **tolerance(function))


def test_unary_edges():
    assert_lowering_matches(aten.special_ndtri.default, torch.tensor([0.0, 1.0, -0.5, 1.5, 0.5]))
    assert_lowering_matches(aten.special_spherical_bessel_j0.default,
                            torch.tensor([0.0, 1e-3, float("inf"), -float("inf")]))
    assert_lowering_matches(aten.special_i1.default, torch.arange(-3, 4))


def test_polygamma_zeta_igamma():
    x = _x(-9.5, 9.5)
    for n in range(1, 4):
        # Elementwise: ELEMENTWISE_ULPS["polygamma"] u per unit of the condition number
        # kappa(x) = 1 + (n+1)|x| / dist(x, Z) next to the poles at x <= 0, times SAFETY (as
        # elementwise_rtol), on the scale 1 + |value| (as atol = rtol does).
        got, expected = run_lowering(aten.polygamma.default, n, x)
        kappa = torch.where(x <= 0, 1 + (n + 1) * x.abs() / (x - x.round()).abs(), torch.ones_like(x))
        bound = elementwise_rtol(torch.float32, "polygamma") * kappa * (1 + expected.abs())
        ratio = (got - expected).abs() / bound
        assert bool((ratio <= 1).all()), f"polygamma({n}): error / bound up to {float(ratio.max()):.2f}"
    assert_lowering_matches(aten.polygamma.default, 0, _x(0.1, 9), **tolerance("digamma"))
    assert_lowering_matches(aten.polygamma.default, 2, torch.tensor([-2.0, 0.0, 1.0]))
    q = _x(0.2, 5)
    assert_lowering_matches(aten.special_zeta.default, torch.full_like(q, 3.0), q, **tolerance("zeta"))
    assert_lowering_matches(aten.special_zeta.other_scalar, _x(1.5, 6), 2.0, **tolerance("zeta"))
    a, y = _x(0.1, 5), _x(0.0, 6)
    assert_lowering_matches(aten.igamma.default, a, y, **tolerance("igamma"))
    assert_lowering_matches(aten.igammac.default, a, y, **tolerance("igamma"))


POLYNOMIALS = ["chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
               "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t",
               "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
               "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he",
               "laguerre_polynomial_l", "legendre_polynomial_p"]


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomials(name):
    packet = getattr(aten, f"special_{name}")
    x = torch.cat([_x(-1.2, 1.2, 40), torch.tensor([-1.0, 0.0, 1.0, 0.5])])
    n = torch.arange(-2, 12, dtype=torch.float32)
    xs, ns = torch.broadcast_tensors(x[:, None], n[None, :])
    # Three-term recurrences up to degree 11, of the measured accuracy (the Chebyshev family
    # its own figure, relative to 1 + |value|: atol = rtol).
    tol = tolerance("chebyshev" if "chebyshev" in name else "polynomial")
    assert_lowering_matches(packet.default, xs, ns, **tol)
    assert_lowering_matches(packet.n_scalar, x, 3, **tol)
    assert_lowering_matches(packet.x_scalar, 0.25, n, **tol)
    assert_lowering_matches(packet.default, x, torch.tensor(2.7))  # n truncates to 2
