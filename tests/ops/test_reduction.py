"""Reduction, scan, sort and topk lowerings against PyTorch on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches, run_lowering
from tests.ops.test_pointwise import make, tolerance
from tpu_train.ops import reduction  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten

DIMS = [None, [], [1], [-1, 0], [0, 1, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool,
                                   torch.uint8])
def test_sum_prod_any_all(dtype):
    x = make((3, 4, 5), dtype, -3, 3)
    tol = tolerance(dtype) * 4
    assert_lowering_matches(aten.sum.default, x, atol=tol, rtol=tol)
    for i, dim in enumerate(DIMS):
        keepdim = i % 2 == 1
        assert_lowering_matches(aten.sum.dim_IntList, x, dim, keepdim, atol=tol, rtol=tol)
        if dim is not None:
            assert_lowering_matches(aten.any.dims, x, dim, keepdim)
            assert_lowering_matches(aten.all.dims, x, dim, keepdim)
    assert_lowering_matches(aten.prod.default, make((6,), dtype, 1, 2), atol=tol, rtol=tol)
    assert_lowering_matches(aten.prod.dim_int, x, 1, keepdim, atol=tol, rtol=tol)
    assert_lowering_matches(aten.any.dim, x, -1, keepdim)
    assert_lowering_matches(aten.all.dim, x, 0, keepdim)
    assert_lowering_matches(aten.any.default, x)
    assert_lowering_matches(aten.all.default, x)
    assert_lowering_matches(aten.count_nonzero.dim_IntList, x, [0, 2])
    assert_lowering_matches(aten.count_nonzero.default, x)


def test_sum_dtype_argument_and_empty_and_zero_dim():
    x = make((4, 5), torch.int8, -100, 100)
    assert_lowering_matches(aten.sum.dim_IntList, x, [0], dtype=torch.float32)
    assert_lowering_matches(aten.sum.default, x, dtype=torch.int32)
    assert_lowering_matches(aten.sum.dim_IntList, torch.empty(0, 3), [0])
    assert_lowering_matches(aten.prod.dim_int, torch.empty(0, 3), 0)
    assert_lowering_matches(aten.sum.dim_IntList, torch.tensor(2.5), [0], True)
    assert_lowering_matches(aten.mean.dim, torch.tensor(2.5), [-1])


def test_bf16_sum_accumulates_in_float32():
    x = torch.full((4096,), 1.0, dtype=torch.bfloat16) + torch.rand(4096).bfloat16() * 1e-2
    # Exactly torch's value: an accumulator in bf16 would stall far below the true sum.
    assert_lowering_matches(aten.sum.default, x, atol=0, rtol=0)
    assert_lowering_matches(aten.mean.dim, x, [0], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mean_and_nansum(dtype):
    x = make((3, 4, 5), dtype)
    tol = tolerance(dtype)
    assert_lowering_matches(aten.mean.default, x, atol=tol, rtol=tol)
    for dim in DIMS[1:]:
        assert_lowering_matches(aten.mean.dim, x, dim, True, atol=tol, rtol=tol)
    assert_lowering_matches(aten.mean.dim, x, [1], dtype=torch.float32, atol=tol, rtol=tol)
    x[0, 0, 0] = float("nan")
    assert_lowering_matches(aten.nansum.default, x, [1, 2], atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_extremes(dtype):
    x = make((4, 6), dtype, -2, 2)  # few distinct values: ties everywhere
    assert_lowering_matches(aten.amax.default, x, [1], True)
    assert_lowering_matches(aten.amin.default, x)
    assert_lowering_matches(aten.max.default, x)
    assert_lowering_matches(aten.min.default, x)
    for dim in (0, -1):
        for keepdim in (False, True):
            assert_lowering_matches(aten.max.dim, x, dim, keepdim)
            assert_lowering_matches(aten.min.dim, x, dim, keepdim)
    if dtype != torch.bool:  # PyTorch has no argmax/argmin/aminmax for bool
        for dim in (0, -1):
            assert_lowering_matches(aten.argmax.default, x, dim, True)
            assert_lowering_matches(aten.argmin.default, x, dim, False)
        assert_lowering_matches(aten.argmax.default, x)
        assert_lowering_matches(aten.argmin.default, x, None, True)
        assert_lowering_matches(aten.aminmax.default, x, dim=1, keepdim=True)
        assert_lowering_matches(aten.aminmax.default, x)


def test_extremes_with_nan_and_zero_dim():
    x = torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [2.0, 5.0, 5.0, -1.0]])
    for op in (aten.max.dim, aten.min.dim):
        assert_lowering_matches(op, x, 1)
    assert_lowering_matches(aten.argmax.default, x, 1)
    assert_lowering_matches(aten.argmin.default, x, 1)
    assert_lowering_matches(aten.amax.default, x, [1])
    assert_lowering_matches(aten.max.dim, torch.tensor(3.0), 0)
    assert_lowering_matches(aten.argmax.default, torch.tensor(3.0), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_var_std(dtype):
    x = make((3, 4, 5), dtype).float() if dtype == torch.int64 else make((3, 4, 5), dtype)
    tol = tolerance(dtype) * 4
    for dim in (None, [0, 2]):
        for correction in (None, 0, 2):
            for op in (aten.var.correction, aten.std.correction, aten.var_mean.correction,
                       aten.std_mean.correction):
                assert_lowering_matches(op, x, dim, correction=correction, keepdim=True,
                                        atol=tol, rtol=tol)
    assert_lowering_matches(aten.var.dim, x, [1], False, atol=tol, rtol=tol)
    assert_lowering_matches(aten.std.dim, x, [1], True, True, atol=tol, rtol=tol)
    # N - correction <= 0: inf / nan as PyTorch, not an error.
    assert_lowering_matches(aten.var.correction, torch.ones(1, 3), [0], correction=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_scans(dtype):
    x = make((3, 7), dtype, -2, 2)
    tol = tolerance(dtype) * 4
    for dim in (0, 1, -1):
        assert_lowering_matches(aten.cumsum.default, x, dim, atol=tol, rtol=tol)
        assert_lowering_matches(aten.cumprod.default, x, dim, atol=tol, rtol=tol)
        if dtype.is_floating_point:
            assert_lowering_matches(aten.logcumsumexp.default, x, dim, atol=tol, rtol=tol)
    assert_lowering_matches(aten.cumsum.default, x, 1, dtype=torch.float32, atol=tol, rtol=tol)
    assert_lowering_matches(aten.cumsum.default, torch.tensor(2), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_logsumexp_and_norms(dtype):
    x = make((3, 4, 5), dtype, -3, 3)
    tol = tolerance(dtype) * 4
    assert_lowering_matches(aten.logsumexp.default, x, [1, 2], atol=tol, rtol=tol)
    assert_lowering_matches(aten.logsumexp.default, x, [0], True, atol=tol, rtol=tol)
    if dtype.is_floating_point:
        for ord in (2, 1, 0, float("inf"), float("-inf"), 3.5, 2.0):
            assert_lowering_matches(aten.linalg_vector_norm.default, x, ord, [1], True,
                                    atol=tol, rtol=tol)
        assert_lowering_matches(aten.linalg_vector_norm.default, x, atol=tol, rtol=tol)
        assert_lowering_matches(aten.linalg_vector_norm.default, x, 2, None, False,
                                dtype=torch.float32, atol=tol, rtol=tol)


def test_logsumexp_infinities():
    x = torch.tensor([[float("inf"), 1.0], [-float("inf"), -float("inf")], [float("nan"), 1.0]])
    assert_lowering_matches(aten.logsumexp.default, x, [1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_is_stable(dtype, descending):
    x = make((5, 9), dtype, -3, 3)  # heavy ties: indices must follow the stable order
    for dim in (0, 1, -1):
        assert_lowering_matches(aten.sort.stable, x, stable=True, dim=dim, descending=descending)
        assert_lowering_matches(aten.argsort.stable, x, stable=True, dim=dim,
                                descending=descending)


def test_sort_nan_and_signed_zero():
    x = torch.tensor([float("nan"), 1.0, -0.0, float("inf"), 0.0, -float("inf"), float("nan"),
                      -0.0])
    for descending in (False, True):
        assert_lowering_matches(aten.sort.stable, x, stable=True, descending=descending)
    (got_values, got_indices), _ = run_lowering(aten.sort.default, x)
    torch.testing.assert_close(got_values, torch.sort(x, stable=True).values, equal_nan=True)


@pytest.mark.parametrize("largest", [True, False])
def test_topk(largest):
    x = torch.randperm(40, generator=torch.Generator().manual_seed(0)).float().reshape(5, 8)
    for k in (0, 1, 3, 8):
        assert_lowering_matches(aten.topk.default, x, k, -1, largest)
    assert_lowering_matches(aten.topk.default, x, 2, 0, largest)
    assert_lowering_matches(aten.topk.default, x.bfloat16(), 3, 1, largest)
