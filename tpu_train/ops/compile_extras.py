"""Lowerings the traced training step needs that no op family provides (yet).

Each is registered only when the table has no lowering for the op, so this module must be
imported after the op families (``tpu_train.compile`` imports it after ``tpu_train.ops``):
a family that later gains the op takes precedence without a registration conflict.
"""

from __future__ import annotations

import jax.numpy as jnp

from tpu_train.ops import registry
from tpu_train.ops.dtypes import storage_dtype
from tpu_train.ops.registry import aten


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """``torch.empty``: contents are unspecified, so zeros (which XLA folds away) are valid.

    Functionalization emits ``empty.memory_format([0], dtype=uint8)`` placeholders for
    mutable-op outputs it discards (e.g. batch norm's reserve space)."""
    import torch

    return jnp.zeros(tuple(size), storage_dtype(dtype or torch.float32))


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _empty(size, dtype=dtype)


_EXTRAS = {
    aten.empty.memory_format: _empty,
    aten.empty_strided.default: _empty_strided,
}

for _op, _fn in _EXTRAS.items():
    if registry.get_lowering(_op) is None:
        registry.lowers(_op)(_fn)
