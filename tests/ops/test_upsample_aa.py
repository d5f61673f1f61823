"""``_upsample_bilinear2d_aa`` and its backward against CPU PyTorch."""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches
from tpu_train.ops import upsample_aa  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten

X = torch.randn(2, 3, 11, 17, generator=torch.Generator().manual_seed(0))
CASES = [  # output size, align_corners, scales: strong and mild down-, up- and mixed sampling
    ((3, 4), False, None), ((8, 13), True, None), ((25, 40), False, None),
    ((5, 30), True, None), ((4, 6), False, (0.4, 0.35)), ((1, 1), True, None),
]


@pytest.mark.parametrize("size, align_corners, scales", CASES)
def test_forward_and_backward(size, align_corners, scales):
    scales = scales or (None, None)
    assert_lowering_matches(aten._upsample_bilinear2d_aa.default, X, size, align_corners,
                            *scales, atol=1e-5, rtol=1e-5)
    grad = torch.randn((2, 3) + size, generator=torch.Generator().manual_seed(1))
    assert_lowering_matches(aten._upsample_bilinear2d_aa_backward.default, grad, size,
                            list(X.shape), align_corners, *scales, atol=1e-5, rtol=1e-5)
