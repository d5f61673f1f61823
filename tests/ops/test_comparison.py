"""Comparison, logical, bitwise, ``where`` and ``masked_fill`` lowerings against PyTorch."""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches
from tests.ops.test_pointwise import make
from tpu_train.ops import comparison  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten

COMPARISONS = [aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge]


@pytest.mark.parametrize("packet", COMPARISONS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.int64, torch.float32),
                                    (torch.bfloat16, torch.float16), (torch.uint8, torch.int8),
                                    (torch.bool, torch.bool)], ids=str)
def test_comparisons(packet, dtypes):
    a = make((4, 5), dtypes[0], -3, 3, seed=1)
    b = make((5,), dtypes[1], -3, 3, seed=2)
    assert_lowering_matches(packet.Tensor, a, b)
    assert_lowering_matches(packet.Tensor, a, torch.tensor(1.5))
    assert_lowering_matches(packet.Scalar, a, 1)
    assert_lowering_matches(packet.Scalar, a, 0.5)  # an int tensor compares as float here


def test_comparisons_with_nan():
    a = torch.tensor([float("nan"), 1.0, float("inf")])
    for packet in COMPARISONS:
        assert_lowering_matches(packet.Tensor, a, torch.tensor([float("nan"), 1.0, 2.0]))


@pytest.mark.parametrize("dtypes", [(torch.bool, torch.bool), (torch.float32, torch.int64),
                                    (torch.int8, torch.uint8)], ids=str)
def test_logical(dtypes):
    a = make((6,), dtypes[0], -1, 1, seed=3)
    b = make((3, 1), dtypes[1], -1, 1, seed=4)
    for op in (aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default):
        assert_lowering_matches(op, a, b)
    assert_lowering_matches(aten.logical_not.default, a)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.uint8, torch.bool])
def test_bitwise(dtype):
    a = make((4, 6), dtype, -50, 50, seed=5)
    b = make((6,), dtype, -50, 50, seed=6)
    for name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
        packet = getattr(aten, name)
        assert_lowering_matches(packet.Tensor, a, b)
        scalar = True if dtype == torch.bool else 12
        assert_lowering_matches(packet.Scalar, a, scalar)
        assert_lowering_matches(packet.Scalar_Tensor, scalar, b)
    assert_lowering_matches(aten.bitwise_not.default, a)


# int64 is stored in 32 bits, so its shifts past bit 31 cannot match: int32 and narrower only.
@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.uint8])
def test_shifts_including_out_of_range_amounts(dtype):
    a = make((10,), dtype, -100, 100, seed=7)
    bits = torch.iinfo(dtype).bits
    amounts = torch.tensor([0, 1, 3, bits - 1, bits, bits + 3, 2, 5, 1, 0]).to(dtype)
    if dtype != torch.uint8:
        amounts[-1] = -1
    for name in ("bitwise_left_shift", "bitwise_right_shift"):
        packet = getattr(aten, name)
        assert_lowering_matches(packet.Tensor, a, amounts)
        assert_lowering_matches(packet.Tensor_Scalar, a, 2)
        assert_lowering_matches(packet.Scalar_Tensor, 5, amounts.clamp(0, 4))
    assert_lowering_matches(aten.__lshift__.Scalar, a, 3)
    assert_lowering_matches(aten.__rshift__.Tensor, a, amounts)


def test_int64_shifts_within_32_bits():
    a = make((8,), torch.int64, -1000, 1000, seed=7)
    amounts = torch.tensor([0, 1, 5, 12, 3, 2, 7, 9])
    assert_lowering_matches(aten.bitwise_left_shift.Tensor, a, amounts)
    assert_lowering_matches(aten.bitwise_right_shift.Tensor, a, amounts)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.int64, torch.float16), (torch.int8, torch.uint8)],
                         ids=str)
def test_where(dtypes):
    condition = make((3, 1, 4), torch.bool, seed=8)
    a = make((5, 4), dtypes[0], seed=9)
    b = make((4,), dtypes[1], seed=10)
    assert_lowering_matches(aten.where.self, condition, a, b)
    assert_lowering_matches(aten.where.self, condition, a, torch.tensor(2.5))
    assert_lowering_matches(aten.where.ScalarOther, condition, a, 1.5)
    assert_lowering_matches(aten.where.ScalarSelf, condition, 3, b)
    assert_lowering_matches(aten.where.Scalar, condition, 3, 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_masked_fill(dtype):
    x = make((3, 4, 5), dtype, seed=11)
    mask = make((4, 1), torch.bool, seed=12)
    value = True if dtype == torch.bool else 7
    assert_lowering_matches(aten.masked_fill.Scalar, x, mask, value)
    assert_lowering_matches(aten.masked_fill.Tensor, x, mask, torch.tensor(value))
    if dtype.is_floating_point:
        assert_lowering_matches(aten.masked_fill.Scalar, x, mask, float("-inf"))
