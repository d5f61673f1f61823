"""The chunked linear_cross_entropy custom ops against ``F.cross_entropy(F.linear(...))``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.ops.lowering_check import to_jax
from tests.tolerances import CROSS_ENTROPY_FUNCTIONS, rtol_for
from tpu_train.ops import linear_cross_entropy as lce

G = torch.Generator().manual_seed(0)
X = torch.randn(9, 5, generator=G)
LINEAR_WEIGHT = torch.randn(7, 5, generator=G)
LINEAR_BIAS = torch.randn(7, generator=G)
TARGET = torch.tensor([0, 3, 6, 2, 2, 5, 1, 4, 3])
CLASS_WEIGHT = torch.rand(7, generator=G) + 0.5
# The linear's 5-long dots, then a log-sum-exp over 7 classes (exp and log once each, as the
# test platform measures them), relative to each result's largest value.
RTOL = rtol_for(torch.float32, reduction=7, depth=2, functions=CROSS_ENTROPY_FUNCTIONS)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * float(want.abs().max()))


def _torch(reduction, bias, weight, ignore_index, label_smoothing):
    x, lw = X.clone().requires_grad_(True), LINEAR_WEIGHT.clone().requires_grad_(True)
    lb = LINEAR_BIAS.clone().requires_grad_(True) if bias else None
    loss = F.cross_entropy(F.linear(x, lw, lb), TARGET, weight=weight, reduction=reduction,
                           ignore_index=ignore_index, label_smoothing=label_smoothing)
    grads = torch.autograd.grad(loss, [x, lw] + ([lb] if bias else []))
    return loss.detach(), grads


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias, weighted, ignore_index, label_smoothing", [
    (False, False, -100, 0.0), (True, True, 3, 0.0), (True, True, 2, 0.2), (False, False, 6, 0.1),
])
def test_reducing_op(reduction, bias, weighted, ignore_index, label_smoothing):
    weight = CLASS_WEIGHT if weighted else None
    want_loss, want_grads = _torch(reduction, bias, weight, ignore_index, label_smoothing)
    got = lce.linear_cross_entropy_batch_chunked(
        to_jax(X), to_jax(LINEAR_WEIGHT), to_jax(TARGET), to_jax(LINEAR_BIAS) if bias else None,
        to_jax(weight), reduction, ignore_index, label_smoothing, 2, "auto", torch.float32,
        True, True, True, bias)
    got = [torch.from_numpy(np.array(g)) for g in got]
    assert_close(got[0], want_loss)
    for g, w in zip(got[1:], want_grads):
        assert_close(g, w)
    if not bias:
        assert got[3].shape == (0,)


def test_no_reduction_op():
    want = F.cross_entropy(F.linear(X, LINEAR_WEIGHT, LINEAR_BIAS), TARGET, weight=CLASS_WEIGHT,
                           ignore_index=5, reduction="none")
    got = lce.linear_cross_entropy_batch_chunked_no_reduction(
        to_jax(X), to_jax(LINEAR_WEIGHT), to_jax(TARGET), to_jax(LINEAR_BIAS),
        to_jax(CLASS_WEIGHT), 5, 2, "auto", torch.float32)
    assert_close(torch.from_numpy(np.array(got)), want)
