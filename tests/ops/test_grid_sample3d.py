"""``grid_sampler_3d`` and its backward against CPU PyTorch, every mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches, to_jax
from tpu_train.ops import grid_sample3d
from tpu_train.ops.registry import aten

G = torch.Generator().manual_seed(0)
INPUT = torch.randn(2, 3, 4, 5, 6, generator=G)
# Points well outside [-1, 1] too, so that every padding mode matters.
GRID = torch.rand(2, 3, 2, 4, 3, generator=G) * 3.2 - 1.6


@pytest.mark.parametrize("interpolation", [0, 1], ids=["trilinear", "nearest"])
@pytest.mark.parametrize("padding", [0, 1, 2], ids=["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_forward_and_backward(interpolation, padding, align_corners):
    args = (interpolation, padding, align_corners)
    assert_lowering_matches(aten.grid_sampler_3d.default, INPUT, GRID, *args, atol=1e-5,
                            rtol=1e-5)
    x, grid = INPUT.clone().requires_grad_(True), GRID.clone().requires_grad_(True)
    out = aten.grid_sampler_3d.default(x, grid, *args)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    want = torch.autograd.grad(out, (x, grid), grad)
    got = grid_sample3d.grid_sampler_3d_backward(to_jax(grad), to_jax(INPUT), to_jax(GRID),
                                                 *args, [True, True])
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.from_numpy(np.array(g)), w, atol=1e-4, rtol=1e-4)
