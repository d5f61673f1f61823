"""Run one lowering directly on JAX arrays and compare it with PyTorch on CPU.

This checks the aten → jax table in isolation (no tpu tensors involved): arguments are CPU
tensors, converted to JAX arrays for the lowering; the result is converted back, cast to the
dtype torch predicts, and compared with the op run by torch itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils._pytree import tree_map

from tpu_train.ops import registry
from tpu_train.ops.dtypes import numpy_dtype, storage_dtype


def to_jax(value):
    """A CPU tensor as a JAX array of its storage dtype, converted on the host and transferred
    with ``jax.device_put``: ``jnp.asarray`` of a NumPy array runs a program (a copy, or the
    conversion) that is compiled for every new shape and dtype, ~45 ms each on a v5e."""
    if isinstance(value, torch.Tensor):
        host = value.detach().cpu()
        if host.dtype == torch.bfloat16:  # NumPy has no bfloat16: through float32, exactly
            return jax.device_put(host.float().numpy().astype(jnp.bfloat16))
        return jax.device_put(np.asarray(host.numpy(), dtype=storage_dtype(host.dtype)))
    return value


def to_torch(array, dtype: torch.dtype) -> torch.Tensor:
    host = np.asarray(jax.device_get(array))
    if dtype == torch.bfloat16:
        return torch.from_numpy(host.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(host.astype(numpy_dtype(dtype)))


def run_lowering(op: torch._ops.OpOverload, *args, rng_key=None, **kwargs):
    lowering = registry.get_lowering(op)
    assert lowering is not None, f"no lowering registered for {op}"
    expected = op(*args, **kwargs)
    jargs, jkwargs = tree_map(to_jax, (args, kwargs))
    if lowering.random:
        jkwargs["rng_key"] = rng_key if rng_key is not None else jax.random.key(0)
    got = lowering.fn(*jargs, **jkwargs)
    if isinstance(expected, torch.Tensor):
        return to_torch(got, expected.dtype), expected
    return [to_torch(g, e.dtype) for g, e in zip(got, expected)], list(expected)


def default_tolerance(dtype: torch.dtype) -> float:
    """Where a test names no tolerance: an elementwise op of the ``"default"`` accuracy (one
    transcendental function with an arithmetic rounding either side, tests/tolerances.py) in
    the result's dtype, used as rtol and as atol (inputs of size ~1); exact (0) for integer
    and bool results. Ops with reductions, and larger inputs, pass their own."""
    # Imported here: scripts/measure_ulps.py uses this module's conversions to measure the
    # figures tests.tolerances is derived from, on a platform that has none yet.
    from tests.tolerances import elementwise_rtol

    if dtype.is_floating_point or dtype.is_complex:
        return elementwise_rtol(dtype, "default")
    return 0.0


def assert_lowering_matches(op, *args, atol=None, rtol=None, **kwargs):
    got, expected = run_lowering(op, *args, **kwargs)
    if isinstance(expected, torch.Tensor):
        got, expected = [got], [expected]
    for g, e in zip(got, expected):
        assert g.shape == e.shape, f"{op}: shape {tuple(g.shape)} != torch's {tuple(e.shape)}"
        default = default_tolerance(e.dtype)
        torch.testing.assert_close(g, e, atol=default if atol is None else atol,
                                   rtol=default if rtol is None else rtol, equal_nan=True,
                                   msg=lambda m: f"{op}: {m}")
