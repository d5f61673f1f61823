"""``rrelu_with_noise_functional`` (random: checked by its distribution's support) and
``allclose`` lowerings against CPU PyTorch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.ops.lowering_check import run_lowering
from tpu_train.ops import allclose, rrelu  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten


def test_rrelu_training_slopes():
    x = jnp.linspace(-4, 4, 4001, dtype=jnp.float32)
    out, noise = rrelu.rrelu_with_noise_functional(x, jnp.zeros_like(x), 0.1, 0.3, True,
                                                   rng_key=jax.random.key(0))
    out, noise, x = np.asarray(out), np.asarray(noise), np.asarray(x)
    negative = x <= 0
    assert np.all(noise[~negative] == 1) and np.all(out[~negative] == x[~negative])
    slopes = noise[negative]
    assert slopes.min() >= 0.1 and slopes.max() < 0.3 and slopes.std() > 0.04
    np.testing.assert_allclose(out[negative], x[negative] * slopes, rtol=1e-6)


def test_rrelu_eval_is_leaky_relu():
    x = torch.linspace(-3, 3, 13)
    noise = torch.full_like(x, 7.0)
    (out, noise_out), _ = run_lowering(aten.rrelu_with_noise_functional.default, x, noise, 0.1,
                                       0.3, False)
    torch.testing.assert_close(out, torch.where(x >= 0, x, x * 0.2))
    torch.testing.assert_close(noise_out, noise)


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("a, b, kwargs", [
    ([1.0, 2.0], [1.0 + 1e-6, 2.0], {}),
    ([1.0, 2.0], [1.0 + 1e-3, 2.0], {}),
    ([1.0, 2.0], [1.05, 2.0], dict(rtol=0.1)),
    ([1.0, 2.0], [1.05, 2.0], dict(rtol=0.0, atol=0.01)),
    ([INF, -INF], [INF, -INF], {}),
    ([INF, 1.0], [-INF, 1.0], {}),
    ([NAN, 1.0], [NAN, 1.0], {}),
    ([NAN, 1.0], [NAN, 1.0], dict(equal_nan=True)),
    ([[1.0], [2.0]], [1.0, 2.0], {}),
])
def test_allclose(a, b, kwargs):
    a, b = torch.tensor(a), torch.tensor(b)
    want = torch.allclose(a, b, **kwargs)
    got = allclose.allclose(jnp.asarray(a.numpy()), jnp.asarray(b.numpy()), **kwargs)
    assert bool(got) == want


def test_allclose_integers():
    a, b = torch.tensor([100, 200]), torch.tensor([100, 201])
    for kwargs in ({}, dict(rtol=0.01)):
        want = torch.allclose(a, b, **kwargs)
        assert bool(allclose.allclose(jnp.asarray(a.numpy()), jnp.asarray(b.numpy()),
                                      **kwargs)) == want
