"""Complex construction, frexp, distance and sampler lowerings."""

from __future__ import annotations

import math

import jax
import torch

from tests.ops.lowering_check import assert_lowering_matches, to_jax
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
    for p in (0.0, 1.0, 2.0, 3.0, math.inf):
        assert_lowering_matches(aten._cdist_forward.default, x1, x2, p, None, atol=1e-5, rtol=1e-4)
        assert_lowering_matches(aten._pdist_forward.default, x1[0], p, atol=1e-5, rtol=1e-4)


def test_samplers_distribution():
    key = jax.random.key(0)
    x = torch.empty(20000)
    c = torch.from_numpy(jax.device_get(get_lowering(aten.cauchy.default).fn(
        to_jax(x), 1.0, 2.0, rng_key=key)).copy())
    assert abs(c.median().item() - 1.0) < 0.1
    g = torch.from_numpy(jax.device_get(get_lowering(aten.geometric.default).fn(
        to_jax(x), 0.25, rng_key=key)).copy())
    assert g.min().item() >= 1 and abs(g.mean().item() - 4.0) < 0.2
    ln = torch.from_numpy(jax.device_get(get_lowering(aten.log_normal.default).fn(
        to_jax(x), 0.0, 0.5, rng_key=key)).copy())
    assert ln.min().item() > 0 and abs(ln.log().std().item() - 0.5) < 0.02
