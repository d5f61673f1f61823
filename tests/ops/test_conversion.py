"""Conversion, copy and factory lowerings, and the PyTorch type-promotion helper."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches
from tests.ops.test_pointwise import make
from tpu_train.ops import conversion  # noqa: F401  (registers the lowerings)
from tpu_train.ops.conversion import result_dtype
from tpu_train.ops.registry import aten

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8,
          torch.bool]


@pytest.mark.parametrize("source", DTYPES)
def test_to_copy_between_dtypes(source):
    x = make((3, 5), source, -6, 6)
    if source.is_floating_point:
        x = torch.cat([x.flatten(), torch.tensor([-2.7, 2.7, -0.0, 0.5], dtype=source)])
    for target in DTYPES:
        if source.is_floating_point and target == torch.uint8:
            x = x.abs()  # negative float → uint8 is undefined behaviour in C++
        assert_lowering_matches(aten._to_copy.default, x, dtype=target)
    assert_lowering_matches(aten._to_copy.default, x)
    assert_lowering_matches(aten.clone.default, x)


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.int64])
def test_prims_convert_element_type(source):
    x = make((4, 3), source, -6, 6)
    for target in (torch.float32, torch.bfloat16, torch.int32, torch.bool):
        assert_lowering_matches(torch.ops.prims.convert_element_type.default, x, target)


def test_copy_fill_and_likes():
    x = make((2, 3, 4), torch.bfloat16)
    assert_lowering_matches(aten.copy.default, x, make((3, 1), torch.int64))
    assert_lowering_matches(aten.fill.Scalar, x, 2.5)
    assert_lowering_matches(aten.fill.Scalar, make((4,), torch.int64), 7)
    assert_lowering_matches(aten.fill.Tensor, x, torch.tensor(-1.25))
    assert_lowering_matches(aten.zero.default, x)
    assert_lowering_matches(aten.full_like.default, x, 3)
    assert_lowering_matches(aten.full_like.default, x, 1.5, dtype=torch.int32)
    assert_lowering_matches(aten.zeros_like.default, x, dtype=torch.bool)
    assert_lowering_matches(aten.ones_like.default, x)
    got = conversion.empty_like(jnp.ones((2, 2), jnp.float32))
    assert got.shape == (2, 2) and got.dtype == jnp.float32


def test_factories():
    assert_lowering_matches(aten.full.default, [2, 3], 1.5)
    assert_lowering_matches(aten.full.default, [2, 3], 4)
    assert_lowering_matches(aten.full.default, [2], True)
    assert_lowering_matches(aten.full.default, [2, 3], 2, dtype=torch.bfloat16)
    assert_lowering_matches(aten.zeros.default, [4, 0])
    assert_lowering_matches(aten.ones.default, [3], dtype=torch.int64)
    assert_lowering_matches(aten.scalar_tensor.default, 3)
    assert_lowering_matches(aten.scalar_tensor.default, 2.5, dtype=torch.bfloat16)


@pytest.mark.parametrize("args", [(0, 10, 1), (2, 11, 3), (10, 0, -2), (0.5, 3.0, 0.25),
                                  (-1, 1, 0.3), (0, 1, 0.1), (5, 5, 1)])
def test_arange(args):
    assert_lowering_matches(aten.arange.start_step, *args)
    assert_lowering_matches(aten.arange.start_step, *args, dtype=torch.float32)
    if all(isinstance(a, int) for a in args):
        assert_lowering_matches(aten.arange.start_step, *args, dtype=torch.int64)
    if args[0] <= args[1]:
        assert_lowering_matches(aten.arange.start, args[0], args[1])
    assert_lowering_matches(aten.arange.default, 7)
    assert_lowering_matches(aten.arange.default, 7, dtype=torch.bfloat16)


@pytest.mark.parametrize("first, second, scalars", [
    (torch.int8, torch.float16, []), (torch.float16, None, [2.5]), (torch.int8, None, [3]),
    (torch.bool, None, [2]), (torch.uint8, torch.int8, []), (torch.bfloat16, torch.float16, []),
    (torch.int32, None, [1.5]), (torch.bool, torch.bool, [True])])
@pytest.mark.parametrize("zero_dim_second", [False, True])
def test_result_dtype_matches_torch(first, second, scalars, zero_dim_second):
    tensors = [torch.zeros(3, dtype=first)]
    if second is not None:
        tensors.append(torch.zeros((() if zero_dim_second else (3,)), dtype=second))
    expected = torch.result_type(tensors[0], tensors[1]) if len(tensors) == 2 else \
        torch.result_type(tensors[0], scalars[0])
    if len(tensors) == 2 and scalars:
        expected = torch.promote_types(expected, torch.result_type(tensors[0], scalars[0]))
    arrays = [jnp.zeros(t.shape, conversion.storage_dtype(t.dtype)) for t in tensors]
    got = result_dtype(*arrays, scalars=scalars)
    assert got == jnp.dtype(conversion.storage_dtype(expected))
