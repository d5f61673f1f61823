"""``_embedding_bag`` (forward and backward) and ``embedding_renorm`` against CPU PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches, to_jax
from tpu_train.ops import embedding_bag as bag_ops
from tpu_train.ops.registry import aten

WEIGHT = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
# Bag 1 is empty; row 3 repeats. include_last_offset appends the end (CPU PyTorch's kernels
# disagree among themselves when that last offset is not len(indices)).
INDICES = torch.tensor([1, 3, 3, 7, 0, 9, 3, 5])
OFFSETS = torch.tensor([0, 3, 3, 6])


def _run(mode, include_last_offset=False, padding_idx=-1, per_sample_weights=None):
    offsets = torch.cat([OFFSETS, torch.tensor([8])]) if include_last_offset else OFFSETS
    args = (WEIGHT, INDICES, offsets, False, mode, False, per_sample_weights,
            include_last_offset, padding_idx)
    want = aten._embedding_bag.default(*args)
    got = bag_ops.embedding_bag(*(to_jax(a) for a in args))
    return [torch.from_numpy(np.array(g)) for g in got], want


@pytest.mark.parametrize("mode", [0, 1, 2], ids=["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_forward(mode, include_last_offset, padding_idx):
    got, want = _run(mode, include_last_offset, padding_idx)
    bags = OFFSETS.shape[0]
    assert got[0].shape == (bags, WEIGHT.shape[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    # offset2bag, bag_size and max_indices have the meta kernel's (non-CPU) shapes.
    assert got[1].tolist() == [0, 0, 0, 2, 2, 2, 3, 3]
    counts = [1, 0, 3, 1] if padding_idx == 3 else [3, 0, 3, 2]
    assert got[2].tolist() == counts + [0] * include_last_offset
    if mode == 2:
        torch.testing.assert_close(got[3], want[3], check_dtype=False)


def test_per_sample_weights():
    psw = torch.linspace(-2, 2, INDICES.shape[0])
    got, want = _run(0, per_sample_weights=psw, padding_idx=3)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", [0, 1, 2], ids=["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [-1, 7])
def test_weight_gradient(mode, padding_idx):
    weight = WEIGHT.clone().requires_grad_(True)
    out = aten._embedding_bag.default(weight, INDICES, OFFSETS, False, mode, False, None, False,
                                      padding_idx)
    grad = torch.randn(out[0].shape, generator=torch.Generator().manual_seed(1))
    (want,) = torch.autograd.grad(out[0], weight, grad)
    _, offset2bag, bag_size, max_indices = bag_ops.embedding_bag(
        to_jax(WEIGHT), to_jax(INDICES), to_jax(OFFSETS), False, mode, False, None, False,
        padding_idx)
    got = bag_ops.embedding_bag_dense_backward(to_jax(grad), to_jax(INDICES), offset2bag,
                                               bag_size, max_indices, WEIGHT.shape[0], False,
                                               mode, None, padding_idx)
    torch.testing.assert_close(torch.from_numpy(np.array(got)), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, float("inf")])
def test_embedding_renorm(norm_type):
    assert_lowering_matches(aten.embedding_renorm.default, WEIGHT * 3, INDICES, 1.5, norm_type,
                            atol=1e-6, rtol=1e-6)
