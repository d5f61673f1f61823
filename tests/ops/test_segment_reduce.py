"""``segment_reduce`` and its backward against CPU PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches, to_jax
from tpu_train.ops import segment_reduce as seg_ops
from tpu_train.ops.registry import aten

REDUCTIONS = ["sum", "mean", "max", "min", "prod"]
# Two rows (axis 1), an empty segment, a zero, tied maxima, a trailing 1-wide feature dim.
DATA = torch.tensor([[1.0, 0.0, 3.0, 3.0, -2.0, 5.0],
                     [2.0, 2.0, -1.0, 4.0, 0.0, 0.0]]).unsqueeze(-1)
LENGTHS = torch.tensor([[2, 0, 3, 1], [1, 2, 0, 3]])
OFFSETS = torch.cat([torch.zeros(2, 1, dtype=torch.long), LENGTHS.cumsum(1)], dim=1)


@pytest.mark.parametrize("reduce", REDUCTIONS)
@pytest.mark.parametrize("initial", [None, 2.0])
def test_forward(reduce, initial):
    for kwargs in (dict(lengths=LENGTHS), dict(offsets=OFFSETS)):
        assert_lowering_matches(aten.segment_reduce.default, DATA, reduce, axis=1,
                                initial=initial, **kwargs)


def test_forward_nan_and_short_offsets():
    data = torch.tensor([1.0, float("nan"), 3.0, 4.0, 5.0])
    for reduce in ("max", "sum"):
        # The last offset stops before the end: element 4 belongs to no segment.
        assert_lowering_matches(aten.segment_reduce.default, data, reduce,
                                offsets=torch.tensor([0, 2, 4]))


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_backward(reduce):
    data = DATA.clone().requires_grad_(True)
    out = torch.segment_reduce(data, reduce, lengths=LENGTHS, axis=1, initial=2.0)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (want,) = torch.autograd.grad(out, data, grad)
    got = seg_ops.segment_reduce_backward(to_jax(grad), to_jax(out.detach()), to_jax(DATA),
                                          reduce, lengths=to_jax(LENGTHS), axis=1, initial=2.0)
    torch.testing.assert_close(torch.from_numpy(np.array(got)), want, atol=1e-6, rtol=1e-6)
