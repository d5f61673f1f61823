"""Random ops on ``jax.random``: each receives its PRNG key as ``rng_key``.

PyTorch's generator streams cannot be reproduced (different PRNG), so these lowerings match
PyTorch in distribution, shape, dtype and range only; a given key always gives the same values.
A ``generator=`` argument is accepted and ignored: the caller derives the key, from the
generator when one is passed. Samples are drawn in float32 and rounded to bf16/f16 afterwards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpu_train.ops.conversion import (DEFAULT_FLOAT, DEFAULT_INT, cast_scalar, convert,
                                      is_floating, opmath_dtype, torch_default_dtype)
from tpu_train.ops.registry import aten, lowers


def _uniform(key, shape, dtype, low=0.0, high=1.0):
    compute = opmath_dtype(dtype)
    sample = jax.random.uniform(key, tuple(shape), compute)
    low, high = cast_scalar(low, compute), cast_scalar(high, compute)
    return (low + sample * (high - low)).astype(dtype)


def _normal(key, shape, dtype, mean=0.0, std=1.0):
    compute = opmath_dtype(dtype)
    sample = jax.random.normal(key, tuple(shape), compute)
    return (sample * std + mean).astype(dtype)


@lowers(aten.uniform.default, random=True)
def uniform(self, from_=0.0, to=1.0, *, generator=None, rng_key):
    return _uniform(rng_key, self.shape, self.dtype, from_, to)


@lowers(aten.normal_functional.default, random=True)
def normal_functional(self, mean=0.0, std=1.0, *, generator=None, rng_key):
    compute = opmath_dtype(self.dtype)
    return _normal(rng_key, self.shape, self.dtype, cast_scalar(mean, compute),
                   cast_scalar(std, compute))


@lowers(aten.normal.Tensor_float, random=True)
def normal_tensor_float(mean, std=1.0, *, generator=None, rng_key):
    compute = opmath_dtype(mean.dtype)
    return _normal(rng_key, mean.shape, mean.dtype, mean.astype(compute),
                   cast_scalar(std, compute))


@lowers(aten.normal.float_Tensor, random=True)
def normal_float_tensor(mean, std, *, generator=None, rng_key):
    compute = opmath_dtype(std.dtype)
    return _normal(rng_key, std.shape, std.dtype, cast_scalar(mean, compute),
                   std.astype(compute))


@lowers(aten.normal.Tensor_Tensor, random=True)
def normal_tensor_tensor(mean, std, *, generator=None, rng_key):
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    dtype = jnp.promote_types(mean.dtype, std.dtype)
    compute = opmath_dtype(dtype)
    return _normal(rng_key, shape, dtype, mean.astype(compute), std.astype(compute))


@lowers(aten.normal.float_float, random=True)
def normal_float_float(mean, std, size, *, generator=None, dtype=None, layout=None, device=None,
                       pin_memory=None, rng_key):
    target = torch_default_dtype(dtype, DEFAULT_FLOAT)
    compute = opmath_dtype(target)
    return _normal(rng_key, size, target, cast_scalar(mean, compute), cast_scalar(std, compute))


@lowers(aten.rand.default, aten.rand.generator, random=True)
def rand(size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None,
         rng_key):
    return _uniform(rng_key, size, torch_default_dtype(dtype, DEFAULT_FLOAT))


@lowers(aten.randn.default, aten.randn.generator, random=True)
def randn(size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None,
          rng_key):
    return _normal(rng_key, size, torch_default_dtype(dtype, DEFAULT_FLOAT))


def _randint(key, low, high, shape, dtype):
    if high <= low:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got "
                           f"from={low} >= to={high}")
    integers = jax.random.randint(key, tuple(shape), low, high, dtype=DEFAULT_INT)
    return convert(integers, dtype)


@lowers(aten.randint.default, aten.randint.generator, random=True)
def randint(high, size, *, generator=None, dtype=None, layout=None, device=None,
            pin_memory=None, rng_key):
    return _randint(rng_key, 0, high, size, torch_default_dtype(dtype, DEFAULT_INT))


@lowers(aten.randint.low, aten.randint.low_generator, random=True)
def randint_low(low, high, size, *, generator=None, dtype=None, layout=None, device=None,
                pin_memory=None, rng_key):
    return _randint(rng_key, low, high, size, torch_default_dtype(dtype, DEFAULT_INT))


@lowers(aten.randperm.default, aten.randperm.generator, random=True)
def randperm(n, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None,
             rng_key):
    permutation = jax.random.permutation(rng_key, jnp.arange(n, dtype=DEFAULT_INT))
    return convert(permutation, torch_default_dtype(dtype, DEFAULT_INT))


def _random_upper_bound(dtype) -> int:
    """Exclusive bound of ``random_()`` without ``to``: every integer the dtype holds exactly."""
    if dtype == jnp.bool_:
        return 2
    if is_floating(dtype):
        # Integers up to 2**digits are exact in the float type (PyTorch's bound, inclusive).
        return min(2 ** (jnp.finfo(dtype).nmant + 1) + 1, 2 ** 31 - 1)
    return int(jnp.iinfo(dtype).max)  # int64 is stored in 32 bits: its int32 range


@lowers(aten.random.default, random=True)
def random_(self, *, generator=None, rng_key):
    return _randint(rng_key, 0, _random_upper_bound(self.dtype), self.shape, self.dtype)


@lowers(getattr(aten.random, "from"), random=True)  # "from" is a Python keyword
def random_from(self, from_, to=None, *, generator=None, rng_key):
    high = _random_upper_bound(self.dtype) if to is None else to
    return _randint(rng_key, from_, high, self.shape, self.dtype)


@lowers(aten.random.to, random=True)
def random_to(self, to, *, generator=None, rng_key):
    return _randint(rng_key, 0, to, self.shape, self.dtype)


@lowers(aten.exponential.default, random=True)
def exponential(self, lambd=1.0, *, generator=None, rng_key):
    compute = opmath_dtype(self.dtype)
    sample = jax.random.exponential(rng_key, self.shape, compute)
    return (sample / cast_scalar(lambd, compute)).astype(self.dtype)


@lowers(aten.bernoulli.default, random=True)
def bernoulli(self, *, generator=None, rng_key):
    sample = jax.random.uniform(rng_key, self.shape, jnp.float32)
    return (sample < self.astype(jnp.float32)).astype(self.dtype)


@lowers(aten.bernoulli.p, random=True)
def bernoulli_p(self, p=0.5, *, generator=None, rng_key):
    sample = jax.random.uniform(rng_key, self.shape, jnp.float32)
    return (sample < cast_scalar(p, jnp.float32)).astype(self.dtype)


@lowers(aten.bernoulli.Tensor, random=True)
def bernoulli_tensor(self, p, *, generator=None, rng_key):
    sample = jax.random.uniform(rng_key, self.shape, jnp.float32)
    return (sample < jnp.broadcast_to(p.astype(jnp.float32), self.shape)).astype(self.dtype)


@lowers(aten.native_dropout.default, random=True)
def native_dropout(input, p, train, *, rng_key):
    """``(output, keep_mask)``: keeps each element with probability ``1 - p``, scaled by
    ``1 / (1 - p)``; ``p = 1`` drops everything (scale 0, not inf)."""
    if train is not None and not train:
        return input, jnp.ones(input.shape, jnp.bool_)
    compute = opmath_dtype(input.dtype) if is_floating(input.dtype) else DEFAULT_FLOAT
    p = cast_scalar(p, compute)
    keep = jax.random.uniform(rng_key, input.shape, jnp.float32) >= p.astype(jnp.float32)
    scale = jnp.where(p >= 1, jnp.zeros((), compute), 1 / (1 - p))
    output = jnp.where(keep, input.astype(compute) * scale, jnp.zeros((), compute))
    return output.astype(input.dtype), keep


@lowers(aten.native_dropout_backward.default)
def native_dropout_backward(grad_output, mask, scale):
    compute = opmath_dtype(grad_output.dtype)
    grad = grad_output.astype(compute) * mask.astype(compute) * cast_scalar(scale, compute)
    return grad.astype(grad_output.dtype)


@lowers(aten.multinomial.default, random=True)
def multinomial(self, num_samples, replacement=False, *, generator=None, rng_key):
    """Samples category indices from (unnormalised) row weights.

    Without replacement this takes the top ``num_samples`` of Gumbel-perturbed log weights,
    which draws the same distribution as sequential sampling without replacement.
    """
    if not replacement and num_samples > self.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without "
                           "replacement")
    logits = jnp.log(self.astype(jnp.float32))
    if replacement:
        samples = jax.random.categorical(rng_key, logits, axis=-1,
                                         shape=(num_samples,) + self.shape[:-1])
        return jnp.moveaxis(samples, 0, -1).astype(DEFAULT_INT)
    perturbed = logits + jax.random.gumbel(rng_key, self.shape, jnp.float32)
    return jax.lax.top_k(perturbed, num_samples)[1].astype(DEFAULT_INT)
