"""``F.grid_sample`` on 4-d inputs (``grid_sampler_2d`` and its backward) against CPU PyTorch:
every interpolation and padding mode, both ``align_corners``, grid points inside, on the edges
and outside the image."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpu_train  # noqa: F401  (registers the tpu device)
from tests.tolerances import rtol_for

G = torch.Generator().manual_seed(0)
IMAGE = torch.randn(2, 3, 5, 7, generator=G)
GRID = torch.rand(2, 4, 6, 2, generator=G) * 2.4 - 1.2
GRID[0, 0, 0] = torch.tensor([-1.0, 1.0])  # exactly on the corners
GRID[0, 0, 1] = torch.tensor([1.0, -1.0])


def _sample(image, grid, device, **kwargs):
    image = image.clone().to(device).requires_grad_()
    grid = grid.clone().to(device).requires_grad_()
    out = F.grid_sample(image, grid, **kwargs)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(device))
    return out.detach().cpu(), image.grad.cpu(), grid.grad.cpu()


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_2d_forward_and_gradients_match_cpu(mode, padding_mode, align_corners):
    kwargs = dict(mode=mode, padding_mode=padding_mode, align_corners=align_corners)
    want = _sample(IMAGE, GRID, "cpu", **kwargs)
    got = _sample(IMAGE, GRID, "tpu", **kwargs)
    rtol = rtol_for(torch.float32, reduction=16)
    for name, g, w in zip(("output", "input gradient", "grid gradient"), got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=1e-5, msg=lambda m: f"{name}: {m}")
