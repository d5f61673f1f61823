"""Mapping between torch dtypes and the JAX dtypes that hold them on a PJRT device.

JAX runs with 64-bit types disabled (XLA on TPU has no f64, and s64 indices slow every
gather), so the torch dtype stays authoritative: an ``int64`` tensor is *stored* as int32 and
reported as int64, a ``float64`` tensor is stored as float32. ``storage_dtype`` says what
holds a torch dtype; converting back to CPU restores the torch dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

_STORAGE = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float32,
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int32,
    torch.uint8: jnp.uint8,
    torch.bool: jnp.bool_,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex64,
}

_TORCH_FROM_JAX = {
    np.dtype(jnp.float32): torch.float32,
    np.dtype(jnp.bfloat16): torch.bfloat16,
    np.dtype(jnp.float16): torch.float16,
    np.dtype(jnp.int8): torch.int8,
    np.dtype(jnp.int16): torch.int16,
    np.dtype(jnp.int32): torch.int32,
    np.dtype(jnp.uint8): torch.uint8,
    np.dtype(jnp.bool_): torch.bool,
    np.dtype(jnp.complex64): torch.complex64,
}


def storage_dtype(dtype: torch.dtype):
    """The JAX dtype that stores ``dtype`` on device; a clear error for the unsupported."""
    try:
        return _STORAGE[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} is not supported on the tpu device; supported: "
            f"{', '.join(str(d) for d in _STORAGE)}") from None


jax_dtype = storage_dtype


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a JAX dtype (int32 maps to int32: callers that know better say so)."""
    return _TORCH_FROM_JAX[np.dtype(dtype)]


def is_floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def numpy_dtype(dtype: torch.dtype):
    """The numpy dtype used to move values of ``dtype`` to/from the host exactly."""
    if dtype == torch.bfloat16:
        return np.dtype(jnp.bfloat16)
    return torch.empty((), dtype=dtype).numpy().dtype
