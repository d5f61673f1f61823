"""Reduction, scan, sort and topk lowerings against PyTorch on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches, run_lowering
from tests.ops.test_pointwise import make
from tests.tolerances import ELEMENTWISE_ULPS, elementwise_rtol, rtol_for
from tpu_train.ops import reduction  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten

DIMS = [None, [], [1], [-1, 0], [0, 1, 2]]


def tolerance(dtype, n, scale=1.0, depth=1, ulps=0):
    """assert_close's (atol, rtol) for reductions of at most ``n`` terms (``depth`` of them
    chained: var's mean then sum of squares) in ``dtype`` (tests/tolerances.py): the sum's
    rounding, rtol_for(float32, n, depth), plus the elementwise functions around it
    (``ulps``: exp / log / pow, elementwise_rtol); 16-bit inputs accumulate in float32 on both
    sides and round the result once to the dtype (elementwise_rtol(dtype)). atol is rtol at
    ``scale``, the size of a typical output (sqrt(n) x the terms' size for a sum of random
    signs), which covers outputs that cancel to near zero. Integer results are exact."""
    if not dtype.is_floating_point:
        return dict(atol=0, rtol=0)
    rtol = rtol_for(torch.float32, n, depth)
    rtol += elementwise_rtol(torch.float32, ulps) if ulps else 0.0
    if dtype != torch.float32:
        rtol += elementwise_rtol(dtype)
    return dict(atol=rtol * scale, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool,
                                   torch.uint8])
def test_sum_prod_any_all(dtype):
    x = make((3, 4, 5), dtype, -3, 3)
    # sums of up to 60 terms of size <= 3; products of up to 6 (relative: no cancellation)
    tol = tolerance(dtype, 60, scale=3 * 60 ** 0.5)
    assert_lowering_matches(aten.sum.default, x, **tol)
    for i, dim in enumerate(DIMS):
        keepdim = i % 2 == 1
        assert_lowering_matches(aten.sum.dim_IntList, x, dim, keepdim, **tol)
        if dim is not None:
            assert_lowering_matches(aten.any.dims, x, dim, keepdim)
            assert_lowering_matches(aten.all.dims, x, dim, keepdim)
    assert_lowering_matches(aten.prod.default, make((6,), dtype, 1, 2), **tol)
    assert_lowering_matches(aten.prod.dim_int, x, 1, keepdim, **tol)
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
    # means of up to 60 terms of size <= 4 (and a division); nansum of 20 terms
    tol = tolerance(dtype, 60, scale=4)
    assert_lowering_matches(aten.mean.default, x, **tol)
    for dim in DIMS[1:]:
        assert_lowering_matches(aten.mean.dim, x, dim, True, **tol)
    assert_lowering_matches(aten.mean.dim, x, [1], dtype=torch.float32, **tol)
    x[0, 0, 0] = float("nan")
    assert_lowering_matches(aten.nansum.default, x, [1, 2],
                            **tolerance(dtype, 20, scale=4 * 20 ** 0.5))


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
    # two chained reductions of up to 60 terms (the mean, then the squared deviations), a
    # sqrt for std; outputs (variance ~5, std, mean) of size <= 4
    tol = tolerance(x.dtype, 60, scale=4, depth=2, ulps="arithmetic")
    for dim in (None, [0, 2]):
        for correction in (None, 0, 2):
            for op in (aten.var.correction, aten.std.correction, aten.var_mean.correction,
                       aten.std_mean.correction):
                assert_lowering_matches(op, x, dim, correction=correction, keepdim=True, **tol)
    assert_lowering_matches(aten.var.dim, x, [1], False, **tol)
    assert_lowering_matches(aten.std.dim, x, [1], True, True, **tol)
    # N - correction <= 0: inf / nan as PyTorch, not an error.
    assert_lowering_matches(aten.var.correction, torch.ones(1, 3), [0], correction=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_scans(dtype):
    x = make((3, 7), dtype, -2, 2)
    # scans of up to 7 terms of size <= 2 (cumprod relative); logcumsumexp adds exp and log
    tol = tolerance(dtype, 7, scale=2 * 7 ** 0.5, ulps=2 * ELEMENTWISE_ULPS["transcendental"])
    for dim in (0, 1, -1):
        assert_lowering_matches(aten.cumsum.default, x, dim, **tol)
        assert_lowering_matches(aten.cumprod.default, x, dim, **tol)
        if dtype.is_floating_point:
            assert_lowering_matches(aten.logcumsumexp.default, x, dim, **tol)
    assert_lowering_matches(aten.cumsum.default, x, 1, dtype=torch.float32,
                            **tolerance(torch.float32, 7, scale=2 * 7 ** 0.5))
    assert_lowering_matches(aten.cumsum.default, torch.tensor(2), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_logsumexp_and_norms(dtype):
    x = make((3, 4, 5), dtype, -3, 3)
    # sums of up to 60 terms, with exp and log (logsumexp) or pow, abs and pow (norms) around
    # them; outputs of size ~3 (an integer input gives a float32 result)
    out = torch.float32 if dtype == torch.int64 else dtype
    tol = tolerance(out, 60, scale=3, ulps=2 * ELEMENTWISE_ULPS["transcendental"])
    assert_lowering_matches(aten.logsumexp.default, x, [1, 2], **tol)
    assert_lowering_matches(aten.logsumexp.default, x, [0], True, **tol)
    if dtype.is_floating_point:
        for ord in (2, 1, 0, float("inf"), float("-inf"), 3.5, 2.0):
            assert_lowering_matches(aten.linalg_vector_norm.default, x, ord, [1], True, **tol)
        assert_lowering_matches(aten.linalg_vector_norm.default, x, **tol)
        assert_lowering_matches(aten.linalg_vector_norm.default, x, 2, None, False,
                                dtype=torch.float32, **tolerance(torch.float32, 60, scale=3,
                                                                 ulps="transcendental"))


@pytest.mark.parametrize("length", [720896, 4100, 96])
def test_2_norm_of_a_long_flat_vector(length):
    """A flat buffer's 2-norm (the optimizer's gradient norms) is summed as rows of up to 512
    when its length allows (720896: 1408 x 512; 4100: 64-row multiples do not divide it, so it
    stays flat; 96: too short): the same value within the rounding of the sum."""
    x = make((length,), torch.float32, -3, 3)
    assert_lowering_matches(aten.linalg_vector_norm.default, x,
                            **tolerance(torch.float32, length, scale=3, ulps="transcendental"))


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
