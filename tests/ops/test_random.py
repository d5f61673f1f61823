"""Random lowerings: PyTorch's streams cannot be matched, so check shape, dtype, range,
statistics and determinism per key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.ops.lowering_check import to_jax
from tests.tolerances import elementwise_rtol
from tpu_train.ops import random  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten, get_lowering

N = 200_000


def five_se(p, n):
    """Sampling error, not rounding: five standard errors of a frequency p over n draws,
    sqrt(p (1 - p) / n) (0 where the outcome is certain)."""
    return 5 * np.sqrt(np.multiply(p, np.subtract(1, p)) / n)


def mean_se5(sigma, n):
    """Five standard errors of the mean of n draws of standard deviation sigma."""
    return 5 * sigma / np.sqrt(n)


def std_se5(sigma, n, kurtosis=3.0):
    """Five standard errors of the standard deviation of n draws: sigma sqrt((kurtosis - 1) /
    (4n)) (normal: kurtosis 3, sigma / sqrt(2n); uniform: 1.8)."""
    return 5 * sigma * np.sqrt((kurtosis - 1) / (4 * n))


def draw(op, *args, seed=0, **kwargs):
    lowering = get_lowering(op)
    assert lowering.random
    args = [to_jax(a) for a in args]
    return lowering.fn(*args, rng_key=jax.random.key(seed), **kwargs)


def as_numpy(array):
    return np.asarray(jnp.asarray(array, jnp.float32) if array.dtype == jnp.bfloat16 else array)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uniform_range_and_moments(dtype):
    out = draw(aten.uniform.default, torch.empty(N, dtype=dtype), -2.0, 3.0)
    assert out.shape == (N,) and out.dtype == to_jax(torch.empty(0, dtype=dtype)).dtype
    values = as_numpy(out)
    assert values.min() >= -2.0 and values.max() <= 3.0
    # Sampling error: five standard errors of U(-2, 3)'s mean and standard deviation.
    sigma = 5 / np.sqrt(12)
    assert abs(values.mean() - 0.5) < mean_se5(sigma, N)
    assert abs(values.std() - sigma) < std_se5(sigma, N, kurtosis=1.8)


def test_same_key_same_values_and_different_keys_differ():
    x = torch.empty(1000)
    first = as_numpy(draw(aten.normal_functional.default, x, seed=1))
    np.testing.assert_array_equal(first, as_numpy(draw(aten.normal_functional.default, x, seed=1)))
    assert not np.array_equal(first, as_numpy(draw(aten.normal_functional.default, x, seed=2)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normal_variants(dtype):
    # Sampling error: five standard errors of each mean / standard deviation (N or N / 2 draws).
    out = as_numpy(draw(aten.normal_functional.default, torch.empty(N, dtype=dtype), 1.5, 2.0))
    assert abs(out.mean() - 1.5) < mean_se5(2.0, N) and abs(out.std() - 2.0) < std_se5(2.0, N)
    mean = torch.tensor([-5.0, 5.0]).repeat(N // 2).to(dtype)
    out = as_numpy(draw(aten.normal.Tensor_float, mean, 0.5))
    assert abs(out[0::2].mean() + 5) < mean_se5(0.5, N // 2)
    assert abs(out[1::2].std() - 0.5) < std_se5(0.5, N // 2)
    std = torch.tensor([0.1, 3.0]).repeat(N // 2).to(dtype)
    out = as_numpy(draw(aten.normal.float_Tensor, 2.0, std))
    assert abs(out[0::2].std() - 0.1) < std_se5(0.1, N // 2)
    assert abs(out[1::2].std() - 3.0) < std_se5(3.0, N // 2)
    out = as_numpy(draw(aten.normal.Tensor_Tensor, mean.reshape(-1, 2), std[:2]))
    assert out.shape == (N // 2, 2) and abs(out[:, 1].mean() - 5) < mean_se5(3.0, N // 2)
    out = draw(aten.normal.float_float, 0.0, 1.0, [3, 4], dtype=dtype)
    assert out.shape == (3, 4)


def test_factories():
    out = as_numpy(draw(aten.rand.default, [N]))
    assert out.dtype == np.float32 and 0 <= out.min() and out.max() < 1
    out = as_numpy(draw(aten.randn.default, [N], dtype=torch.bfloat16))
    # Sampling error: five standard errors of the mean (1 / sqrt(N)) and of the standard
    # deviation (1 / sqrt(2N)) of N unit normals (bf16's rounding moves them by ~2^-9 / sqrt(N)).
    assert abs(out.mean()) < 5 / np.sqrt(N) and abs(out.std() - 1) < 5 / np.sqrt(2 * N)
    out = as_numpy(draw(aten.randint.low, -3, 7, [N]))
    assert out.min() == -3 and out.max() == 6 and np.issubdtype(out.dtype, np.integer)
    out = as_numpy(draw(aten.randint.default, 5, [N], dtype=torch.float32))
    assert set(np.unique(out)) == {0, 1, 2, 3, 4}
    perm = as_numpy(draw(aten.randperm.default, 1000))
    assert sorted(perm.tolist()) == list(range(1000)) and perm.tolist() != list(range(1000))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8, torch.bool])
def test_random_integer_ranges(dtype):
    x = torch.empty(N, dtype=dtype)
    out = as_numpy(draw(aten.random.to, x, 10 if dtype != torch.bool else 2))
    assert out.min() == 0 and out.max() == (9 if dtype != torch.bool else 1)
    out = as_numpy(draw(getattr(aten.random, "from"), x, 1 if dtype != torch.bool else 0, None))
    assert out.min() >= 0
    out = as_numpy(draw(aten.random.default, x)).astype(np.float64)
    assert out.min() >= 0 and out.max() >= (1 if dtype == torch.bool else 200)


def test_exponential_and_bernoulli():
    out = as_numpy(draw(aten.exponential.default, torch.empty(N), 4.0))
    # Sampling error: five standard errors of the mean of N Exp(rate 4) draws (0.25 / sqrt(N)),
    # and of each Bernoulli frequency (five_se).
    assert out.min() >= 0 and abs(out.mean() - 0.25) < 5 * 0.25 / np.sqrt(N)
    probabilities = torch.tensor([0.1, 0.9]).repeat(N // 2)
    out = as_numpy(draw(aten.bernoulli.default, probabilities))
    assert set(np.unique(out)) <= {0.0, 1.0}
    assert abs(out[0::2].mean() - 0.1) < five_se(0.1, N // 2)
    assert abs(out[1::2].mean() - 0.9) < five_se(0.9, N // 2)
    out = as_numpy(draw(aten.bernoulli.p, torch.empty(N, dtype=torch.bfloat16), 0.3))
    assert abs(out.mean() - 0.3) < five_se(0.3, N)
    out = as_numpy(draw(aten.bernoulli.Tensor, torch.empty(N // 2, 2), torch.tensor([0.2, 0.7])))
    assert abs(out[:, 0].mean() - 0.2) < five_se(0.2, N // 2)
    assert abs(out[:, 1].mean() - 0.7) < five_se(0.7, N // 2)


@pytest.mark.parametrize("p", [0.0, 0.25, 0.9, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_dropout_rate_and_scale(p, dtype):
    x = torch.rand(N).to(dtype) + 0.5
    output, mask = draw(aten.native_dropout.default, x, p, True)
    output, mask, x = as_numpy(output), np.asarray(mask), x.float().numpy()
    # The kept fraction: sampling error, five standard errors (exact for p = 0 and 1).
    assert mask.dtype == np.bool_ and abs(mask.mean() - (1 - p)) <= five_se(1 - p, N)
    assert np.all(output[~mask] == 0)
    if p < 1:
        # Rounding: x * (1 / (1 - p)), three correctly rounded operations (1 - p, the
        # reciprocal, the product), bf16 rounding the output once.
        np.testing.assert_allclose(output[mask], x[mask] / (1 - p), rtol=elementwise_rtol(dtype, 3))
    grad = torch.ones(N)
    expected_scale = 0.0 if p == 1 else 1 / (1 - p)
    got = get_lowering(aten.native_dropout_backward.default).fn(
        to_jax(grad), jnp.asarray(mask), expected_scale)
    # grad * mask * scale: the scale rounded to float32, one product.
    np.testing.assert_allclose(np.asarray(got), mask * expected_scale,
                               rtol=elementwise_rtol(torch.float32, 2))


def test_native_dropout_eval_and_traced_p():
    x = torch.rand(100)
    output, mask = draw(aten.native_dropout.default, x, 0.5, False)
    np.testing.assert_array_equal(as_numpy(output), x.numpy())
    assert np.asarray(mask).all()
    lowering = get_lowering(aten.native_dropout.default).fn
    run = jax.jit(lambda a, p, key: lowering(a, p, True, rng_key=key))
    output, mask = run(to_jax(torch.ones(N)), jnp.float32(0.2), jax.random.key(3))
    assert abs(np.asarray(mask).mean() - 0.8) < five_se(0.8, N)  # sampling error
    # Rounding: 1 * (1 / (1 - p)) in float32, three correctly rounded operations.
    np.testing.assert_allclose(np.asarray(output)[np.asarray(mask)], 1.25,
                               rtol=elementwise_rtol(torch.float32, 3))


@pytest.mark.parametrize("replacement", [True, False])
def test_multinomial(replacement):
    weights = torch.tensor([[1.0, 0.0, 3.0, 6.0], [0.0, 0.0, 1.0, 0.0]])
    samples = np.asarray(draw(aten.multinomial.default, weights, 4000 if replacement else 3,
                              replacement))
    assert samples.shape == (2, 4000 if replacement else 3)
    if replacement:
        frequencies = np.bincount(samples[0], minlength=4) / 4000
        # Sampling error: five standard errors per category (a zero weight is never drawn).
        expected = np.array([0.1, 0.0, 0.3, 0.6])
        assert np.all(np.abs(frequencies - expected) <= five_se(expected, 4000)), frequencies
        assert np.all(samples[1] == 2)
    else:
        assert 1 not in samples[0] and len(set(samples[0].tolist())) == 3
        assert samples[1, 0] == 2
