"""Bessel J/Y, modified Bessel K and Airy Ai lowerings (tpu_train/ops/bessel.py).

Accuracy is checked against PyTorch's float64 kernels (float32 results, so a few float32 ulps
of ``1 + |f|``, the atol = rtol convention of tests/tolerances.py); domain edges, dtypes and
the float32 kernels are checked against CPU PyTorch directly.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches, run_lowering
from tpu_train.ops import bessel  # noqa: F401  (registers the lowerings)
from tpu_train.ops.registry import aten

ULP = 2.0 ** -24
# Measured largest errors against the float64 kernels on these ranges: 2.9 .. 13 ulps.
ULPS = 16
# ATen's Airy kernel, in double precision too, is ~40 float32 ulps off just below x = -2.09
# where it switches to its asymptotic form; the lowering is accurate there (scipy agrees).
AIRY_ULPS = 48

CASES = [
    ("bessel_j0", -30, 30), ("bessel_j1", -30, 30), ("bessel_y0", 1e-3, 30),
    ("bessel_y1", 0.05, 30), ("modified_bessel_k0", 1e-3, 20), ("modified_bessel_k1", 0.05, 20),
    ("scaled_modified_bessel_k0", 1e-3, 60), ("scaled_modified_bessel_k1", 0.05, 60),
    ("airy_ai", -10, 10),
]


def _op(name):
    return getattr(aten, f"special_{name}").default


@pytest.mark.parametrize("name, low, high", CASES, ids=[c[0] for c in CASES])
def test_accuracy_against_float64(name, low, high):
    op = _op(name)
    # Both sides of every split point (8, 2, -4, and ATen's 5 and -2.09) lie in these grids.
    x = torch.linspace(low, high, 30001)
    got, _ = run_lowering(op, x)
    ref = op(x.double())
    ulps = ((got.double() - ref).abs() / (ULP * (1 + ref.abs()))).max().item()
    assert ulps <= (AIRY_ULPS if name == "airy_ai" else ULPS), f"{name}: {ulps:.1f} ulps"


EDGES = torch.tensor([float("-inf"), -3.0, -1e-30, -0.0, 0.0, 1e-30, 1e-6, 0.5, 2.0, 7.99, 8.0,
                      8.01, 30.0, 90.0, 200.0, 1e4, float("inf"), float("nan")])


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_edges_match_torch(name):
    # inf / NaN / signed zeros and points where the working precision's exp under- or
    # overflows. 1e4 is far out on the oscillating asymptotics (phase rounded as ATen does).
    assert_lowering_matches(_op(name), EDGES, atol=1e-6, rtol=4 * ULPS * ULP)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float64])
def test_dtypes(dtype):
    # CPU PyTorch has no 16-bit float kernels for these; integers and bool compute in float32.
    x = torch.tensor([1, 2, 3, 7, 9, 12]).to(dtype)
    for name, _, _ in CASES:
        got, want = run_lowering(_op(name), x)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=name)
