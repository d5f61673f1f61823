"""Upsampling backward, bicubic / nearest-exact and adaptive max pooling against PyTorch on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches
from tpu_train.ops.registry import aten

TOL = dict(atol=1e-5, rtol=1e-5)


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("out", [(5, 7), (2, 3)])
def test_bicubic(align_corners, out):
    x = rand(1, 2, 4, 5)
    assert_lowering_matches(aten.upsample_bicubic2d.default, x, out, align_corners, **TOL)
    g = rand(1, 2, *out, seed=1)
    assert_lowering_matches(aten.upsample_bicubic2d_backward.default, g, out, x.shape,
                            align_corners, **TOL)


@pytest.mark.parametrize("spatial", [1, 2, 3])
def test_nearest_exact_and_backward(spatial):
    x = rand(1, 2, *([3] * spatial))
    out = [5] * spatial
    g = rand(1, 2, *out, seed=1)
    exact = getattr(aten, f"_upsample_nearest_exact{spatial}d")
    assert_lowering_matches(exact.default, x, out, **TOL)
    back = getattr(aten, f"_upsample_nearest_exact{spatial}d_backward")
    assert_lowering_matches(back.default, g, out, x.shape, **TOL)
    nearest = getattr(aten, f"upsample_nearest{spatial}d_backward")
    assert_lowering_matches(nearest.default, g, out, x.shape, **TOL)


def test_linear_backward():
    g1 = rand(1, 2, 7, seed=2)
    assert_lowering_matches(aten.upsample_linear1d_backward.default, g1, [7], [1, 2, 4], False,
                            **TOL)
    g3 = rand(1, 1, 3, 4, 5, seed=3)
    assert_lowering_matches(aten.upsample_trilinear3d_backward.default, g3, [3, 4, 5],
                            [1, 1, 2, 3, 2], True, **TOL)


@pytest.mark.parametrize("spatial,out", [(2, [3, 2]), (3, [2, 3, 2])])
def test_adaptive_max_pool(spatial, out):
    x = rand(2, 3, *([5] * spatial), seed=4)
    forward = getattr(aten, f"adaptive_max_pool{spatial}d").default
    if spatial == 2:
        assert_lowering_matches(forward, x, out, **TOL)
    values, indices = forward(x, out)
    backward = getattr(aten, f"adaptive_max_pool{spatial}d_backward").default
    assert_lowering_matches(backward, rand(*values.shape, seed=5), x, indices, **TOL)
