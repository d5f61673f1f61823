"""``histogram`` / ``histogramdd`` lowerings against CPU PyTorch."""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches
from tpu_train.ops import histogram  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten

# Values on interior edges and on the right edge (which the last bin includes), outside the
# range, and NaN.
X = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.5, -0.1, 0.3, float("nan"), 0.999])
W = torch.linspace(0.5, 2.0, X.numel())


@pytest.mark.parametrize("kwargs", [
    dict(range=[0.0, 1.0]),
    dict(range=[0.0, 1.0], weight=W),
    dict(range=[0.0, 1.0], weight=W, density=True),
    dict(range=[2.0, 2.0]),
])
def test_histogram_bins(kwargs):
    assert_lowering_matches(aten.histogram.bin_ct, X, 4, **kwargs)


def test_histogram_data_range_and_degenerate():
    x = torch.randn(7, 9, generator=torch.Generator().manual_seed(0))
    assert_lowering_matches(aten.histogram.bin_ct, x, 6, density=True)
    assert_lowering_matches(aten.histogram.bin_ct, torch.full((5,), 3.0), 3)
    assert_lowering_matches(aten.histogram.bin_ct, torch.zeros(0), 2)


def test_histogram_bin_tensor():
    edges = torch.tensor([0.0, 0.1, 0.5, 1.0])
    assert_lowering_matches(aten.histogram.bins_tensor, X, edges, weight=W)


def test_histogramdd():
    x = torch.rand(50, 3, generator=torch.Generator().manual_seed(1)) * 2 - 0.5
    w = torch.rand(50, generator=torch.Generator().manual_seed(2))
    for op in (aten._histogramdd_bin_edges.default, aten._histogramdd_from_bin_cts.default):
        assert_lowering_matches(op, x, [2, 3, 4])
        assert_lowering_matches(op, x, [2, 3, 4], range=[0.0, 1.0, -0.5, 0.5, 0.0, 2.0],
                                weight=w, density=True)
    edges = [torch.tensor([0.0, 0.5, 1.0]), torch.tensor([-1.0, 0.0, 2.0]),
             torch.tensor([0.0, 1.0])]
    assert_lowering_matches(aten._histogramdd_from_bin_tensors.default, x, edges, weight=w)
