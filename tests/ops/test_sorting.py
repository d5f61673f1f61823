"""Order-statistic and search lowerings against PyTorch on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches, to_jax
from tpu_train.ops import sorting  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten, get_lowering


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_cummax_cummin_ties_and_nan():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, float("nan"), 5.0, float("nan"), 0.0],
                      [2.0, 2.0, 1.0, 1.0, 4.0, 4.0, -1.0, -1.0]])
    for op in (aten.cummax.default, aten.cummin.default):
        assert_lowering_matches(op, x, 1)
        assert_lowering_matches(op, x, 0)
        assert_lowering_matches(op, _x(3, 4, 5), -2)
        assert_lowering_matches(op, torch.tensor([1, 1, 0, 2]), 0)


def test_median_family():
    x = _x(4, 6)
    nan = x.clone()
    nan[0, 2] = nan[0, 4] = nan[2, 1] = float("nan")
    nan[3, :5] = float("nan")  # (an all-NaN row's nanmedian index is left unspecified)
    for t in (x, nan):
        assert_lowering_matches(aten.median.default, t)
        assert_lowering_matches(aten.nanmedian.default, t)
        for dim, keep in ((1, False), (0, True)):
            assert_lowering_matches(aten.median.dim, t, dim, keep)
            assert_lowering_matches(aten.nanmedian.dim, t, dim, keep)
    for k in (1, 3, 6):
        assert_lowering_matches(aten.kthvalue.default, x, k, 1, k == 3)
    assert_lowering_matches(aten.kthvalue.default, nan[:3], 2, 1)  # (which NaN is unspecified)


def test_mode():
    x = torch.tensor([[1.0, 2.0, 2.0, 1.0, 3.0], [5.0, 4.0, 4.0, 4.0, 5.0], [7.0, 6.0, 8.0, 9.0, 0.0]])
    assert_lowering_matches(aten.mode.default, x, 1, False)
    assert_lowering_matches(aten.mode.default, x.t().contiguous(), 0, True)
    assert_lowering_matches(aten.mode.default, torch.tensor([3, 1, 3, 1, 2]), 0)


def test_searchsorted_bucketize():
    seq = torch.sort(_x(10)).values
    values = _x(3, 7, seed=1)
    for right in (False, True):
        assert_lowering_matches(aten.searchsorted.Tensor, seq, values, right=right)
        assert_lowering_matches(aten.bucketize.Tensor, values, seq, right=right, out_int32=True)
        assert_lowering_matches(aten.searchsorted.Scalar, seq, 0.1, right=right)
    batched = torch.sort(_x(3, 5, seed=2)).values
    assert_lowering_matches(aten.searchsorted.Tensor, batched, values, side="right")
    assert_lowering_matches(aten.searchsorted.Tensor, seq[[0, 0, 3, 3, 9]], seq[[0, 3, 9]])
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(3))
    unsorted = seq[perm]
    assert_lowering_matches(aten.searchsorted.Tensor, unsorted, values,
                            sorter=torch.argsort(unsorted))


def test_histc_and_equal():
    x = _x(50)
    assert_lowering_matches(aten.histc.default, x, 10, -1.0, 1.0)
    assert_lowering_matches(aten.histc.default, x, 7)
    assert_lowering_matches(aten.histc.default, torch.full((4,), 2.0), 5)
    equal = get_lowering(aten.equal.default).fn
    assert bool(equal(to_jax(x), to_jax(x.clone())))
    assert not bool(equal(to_jax(x), to_jax(x + 1)))
    assert not bool(equal(to_jax(x), to_jax(x[:3])))
    assert not bool(equal(to_jax(torch.tensor([float("nan")])), to_jax(torch.tensor([float("nan")]))))


@pytest.mark.parametrize("flags", [(False, False), (True, True)])
def test_unique(flags):
    x = torch.tensor([[3.0, 1.0, 3.0], [2.0, 1.0, 5.0]])
    assert_lowering_matches(aten._unique2.default, x, True, *flags, atol=0, rtol=0)
    assert_lowering_matches(aten.unique_consecutive.default, x, *flags, atol=0, rtol=0)
    y = torch.tensor([[1.0, 1.0, 2.0], [1.0, 1.0, 2.0]])
    assert_lowering_matches(aten.unique_consecutive.default, y, *flags, 1, atol=0, rtol=0)
