"""Special-function lowerings against PyTorch on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches
from tpu_train.ops import special  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten


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
    assert_lowering_matches(op, _x(low, high), atol=1e-5, rtol=2e-5)


def test_unary_edges():
    assert_lowering_matches(aten.special_ndtri.default, torch.tensor([0.0, 1.0, -0.5, 1.5, 0.5]))
    assert_lowering_matches(aten.special_spherical_bessel_j0.default,
                            torch.tensor([0.0, 1e-3, float("inf"), -float("inf")]))
    assert_lowering_matches(aten.special_i1.default, torch.arange(-3, 4))


def test_polygamma_zeta_igamma():
    x = _x(-9.5, 9.5)
    for n in range(1, 4):
        assert_lowering_matches(aten.polygamma.default, n, x, atol=1e-3, rtol=1e-4)
    assert_lowering_matches(aten.polygamma.default, 0, _x(0.1, 9))
    assert_lowering_matches(aten.polygamma.default, 2, torch.tensor([-2.0, 0.0, 1.0]))
    q = _x(0.2, 5)
    assert_lowering_matches(aten.special_zeta.default, torch.full_like(q, 3.0), q, rtol=1e-4)
    assert_lowering_matches(aten.special_zeta.other_scalar, _x(1.5, 6), 2.0, rtol=1e-4)
    a, y = _x(0.1, 5), _x(0.0, 6)
    assert_lowering_matches(aten.igamma.default, a, y, atol=1e-5, rtol=1e-4)
    assert_lowering_matches(aten.igammac.default, a, y, atol=1e-5, rtol=1e-4)


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
    assert_lowering_matches(packet.default, xs, ns, atol=1e-3, rtol=1e-4)
    assert_lowering_matches(packet.n_scalar, x, 3, atol=1e-4, rtol=1e-4)
    assert_lowering_matches(packet.x_scalar, 0.25, n, atol=1e-4, rtol=1e-4)
    assert_lowering_matches(packet.default, x, torch.tensor(2.7))  # n truncates to 2
