"""Complex construction, frexp, distance and sampler lowerings."""

from __future__ import annotations

import math

import jax
import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches, to_jax
from tests.tolerances import elementwise_rtol, rtol_for
from tpu_train.ops import misc  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten, get_lowering


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_complex_polar_angle_conj():
    a, b = _x(3, 4), _x(3, 4, seed=1)
    assert_lowering_matches(aten.complex.default, a, b)
    assert_lowering_matches(aten.polar.default, a.abs(), b)
    assert_lowering_matches(aten.angle.default, torch.tensor([-1.0, 0.0, 2.0, float("nan")]))
    assert_lowering_matches(aten.angle.default, torch.tensor([-2, 0, 3]))
    assert_lowering_matches(aten.angle.default, torch.complex(a, b))
    assert_lowering_matches(aten._conj_physical.default, torch.complex(a, b))


def test_frexp():
    x = torch.cat([_x(20) * 100, torch.tensor([0.0, 1.0, -0.75, 1e-30])])
    assert_lowering_matches(aten.frexp.Tensor, x)


def test_cdist_pdist():
    x1, x2 = _x(2, 5, 3), _x(2, 4, 3, seed=1)
    # (sum over the 3 features of |x - y|^p)^(1/p): a reduction of length 3 with pow either
    # side ("default" accuracy) (tests/tolerances.py). x - y is off by u |x| absolutely, so
    # the atol is rtol at the inputs' size.
    rtol = rtol_for(torch.float32, 3) + elementwise_rtol(torch.float32, "default")
    atol = rtol * float(torch.cat([x1.flatten(), x2.flatten()]).abs().max())
    for p in (0.0, 1.0, 2.0, 3.0, math.inf):
        assert_lowering_matches(aten._cdist_forward.default, x1, x2, p, None, atol=atol, rtol=rtol)
        assert_lowering_matches(aten._pdist_forward.default, x1[0], p, atol=atol, rtol=rtol)


def test_samplers_distribution():
    # Sampling error, not rounding: each statistic of n draws is allowed five standard errors.
    key = jax.random.key(0)
    n = 20000
    x = torch.empty(n)
    c = torch.from_numpy(jax.device_get(get_lowering(aten.cauchy.default).fn(
        to_jax(x), 1.0, 2.0, rng_key=key)).copy())
    # The median of Cauchy(1, scale 2): standard error pi * scale / (2 sqrt(n)) (0.022).
    assert abs(c.median().item() - 1.0) < 5 * math.pi * 2.0 / (2 * math.sqrt(n))
    g = torch.from_numpy(jax.device_get(get_lowering(aten.geometric.default).fn(
        to_jax(x), 0.25, rng_key=key)).copy())
    # The mean of Geometric(0.25) (4): standard error sqrt(1 - p) / p / sqrt(n) (0.024).
    assert g.min().item() >= 1 and abs(g.mean().item() - 4.0) < 5 * math.sqrt(0.75) / 0.25 / math.sqrt(n)
    ln = torch.from_numpy(jax.device_get(get_lowering(aten.log_normal.default).fn(
        to_jax(x), 0.0, 0.5, rng_key=key)).copy())
    # The standard deviation of n normal draws (0.5): standard error sigma / sqrt(2n) (0.0025).
    assert ln.min().item() > 0 and abs(ln.log().std().item() - 0.5) < 5 * 0.5 / math.sqrt(2 * n)


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, 3.0, math.inf])
def test_cdist_pdist_backward(p):
    x1, x2 = _x(2, 4, 3), _x(1, 5, 3, seed=1)
    x1[0, 0] = x2[0, 0]  # a zero distance: its gradient is 0
    d = torch.cdist(x1, x2, p)
    g = _x(2, 4, 5, seed=2)
    assert_lowering_matches(aten._cdist_backward.default, g, x1, x2, p, d, atol=1e-5, rtol=1e-5)
    x = _x(5, 3, seed=3)
    pd = torch.pdist(x, p)
    assert_lowering_matches(aten._pdist_backward.default, _x(*pd.shape, seed=4), x, p, pd,
                            atol=1e-5, rtol=1e-5)
