"""FFT primitive lowerings against PyTorch on CPU."""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches
from tpu_train.ops import fft  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten

TOL = dict(atol=1e-4, rtol=1e-4)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm", [0, 1, 2])
def test_r2c_c2c_c2r(norm):
    x = _x(3, 6, 5)
    z = torch.complex(x, _x(3, 6, 5, seed=1))
    for dim in ([2], [1, 2], [0, 2]):
        for onesided in (True, False):
            assert_lowering_matches(aten._fft_r2c.default, x, dim, norm, onesided, **TOL)
        for forward in (True, False):
            assert_lowering_matches(aten._fft_c2c.default, z, dim, norm, forward, **TOL)
    half = z[..., :3]
    for last in (4, 5):
        assert_lowering_matches(aten._fft_c2r.default, half, [2], norm, last, **TOL)
        assert_lowering_matches(aten._fft_c2r.default, half, [0, 2], norm, last, **TOL)
