"""``fractional_max_pool2d/3d`` and their backward against CPU PyTorch, given the same samples."""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches
from tpu_train.ops import fractional_pool  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten

CASES = [  # input shape, kernel, output size: batched and not, uneven windows, a NaN
    ((2, 3, 11, 9), (3, 2), (4, 5)),
    ((2, 7, 9, 8), (2, 3, 2), (3, 4, 2)),
]


def _inputs(shape, kernel):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=g)
    x.view(-1)[5] = float("nan")
    batch = 1 if len(shape) == len(kernel) + 1 else shape[0]
    samples = torch.rand(batch, shape[-len(kernel) - 1], len(kernel), generator=g)
    return x, samples


def _ops(kernel):
    if len(kernel) == 2:
        return aten.fractional_max_pool2d.default, aten.fractional_max_pool2d_backward.default
    return aten.fractional_max_pool3d.default, aten.fractional_max_pool3d_backward.default


@pytest.mark.parametrize("shape, kernel, output_size", CASES)
def test_forward_and_backward(shape, kernel, output_size):
    x, samples = _inputs(shape, kernel)
    forward, backward = _ops(kernel)
    # Values and int64 indices exactly (the first maximum of each window, NaN wins).
    assert_lowering_matches(forward, x, kernel, output_size, samples, atol=0, rtol=0)
    out, indices = forward(x, kernel, output_size, samples)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    assert_lowering_matches(backward, grad, x, kernel, output_size, indices, atol=1e-6,
                            rtol=1e-6)
