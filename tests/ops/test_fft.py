"""FFT primitive lowerings against PyTorch on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches
from tests.tolerances import elementwise_rtol, rtol_for
from tpu_train.ops import fft  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten


def check(op, x, dims, *args):
    """An FFT over ``dims`` (total length n) is ceil(log2 n) chained stages of butterflies,
    each a sum of 2 terms times a twiddle factor (sin / cos, "transcendental" accuracy), so
    its normwise error grows like log2(n) * u (tests/tolerances.py): rtol_for(float32, 2,
    depth=ceil(log2 n)) + elementwise_rtol(float32, "transcendental"). The bound is normwise:
    an output element is off by up to rtol times the output's RMS (the atol)."""
    expected = op(x, dims, *args)
    # The transform's length per dim: the larger of input and output (one-sided halves).
    n = math.prod(max(x.shape[d], expected.shape[d]) for d in dims)
    rtol = rtol_for(torch.float32, 2, depth=max(1, math.ceil(math.log2(n)))) \
        + elementwise_rtol(torch.float32, "transcendental")
    rms = float(expected.abs().pow(2).mean().sqrt())
    assert_lowering_matches(op, x, dims, *args, atol=rtol * rms, rtol=rtol)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm", [0, 1, 2])
def test_r2c_c2c_c2r(norm):
    x = _x(3, 6, 5)
    z = torch.complex(x, _x(3, 6, 5, seed=1))
    for dim in ([2], [1, 2], [0, 2]):
        for onesided in (True, False):
            check(aten._fft_r2c.default, x, dim, norm, onesided)
        for forward in (True, False):
            check(aten._fft_c2c.default, z, dim, norm, forward)
    half = z[..., :3]
    for last in (4, 5):
        check(aten._fft_c2r.default, half, [2], norm, last)
        check(aten._fft_c2r.default, half, [0, 2], norm, last)
