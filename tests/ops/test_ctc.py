"""``_ctc_loss`` and its backward against CPU PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops.lowering_check import to_jax
from tpu_train.ops import ctc
from tpu_train.ops.registry import aten

G = torch.Generator().manual_seed(0)
LOG_PROBS = torch.randn(12, 4, 6, generator=G).log_softmax(-1)
INPUT_LENGTHS = [12, 10, 7, 3]
# Repeated labels (need a blank between), an empty target, one too long for its input.
TARGETS = torch.tensor([[1, 2, 2, 3, 5], [4, 4, 4, 0, 0], [1, 0, 0, 0, 0], [1, 2, 3, 4, 0]])
TARGET_LENGTHS = [5, 3, 0, 4]


@pytest.mark.parametrize("zero_infinity", [False, True])
@pytest.mark.parametrize("layout", ["padded", "concatenated"])
def test_forward(zero_infinity, layout):
    targets = TARGETS
    if layout == "concatenated":
        targets = torch.cat([t[:n] for t, n in zip(TARGETS, TARGET_LENGTHS)])
    args = (LOG_PROBS, targets, INPUT_LENGTHS, TARGET_LENGTHS, 0, zero_infinity)
    want_nll, want_alpha = aten._ctc_loss.default(*args)
    nll, log_alpha = (torch.from_numpy(np.array(x)) for x in ctc.ctc_loss(*map(to_jax, args)))
    # _ctc_loss keeps an infinite loss (index 3) whatever zero_infinity says.
    torch.testing.assert_close(nll, want_nll, atol=1e-5, rtol=1e-5)
    # log_alpha where ATen defines it (within each sequence's input and extended target).
    for b, (steps, n) in enumerate(zip(INPUT_LENGTHS, TARGET_LENGTHS)):
        torch.testing.assert_close(log_alpha[b, :steps, :2 * n + 1],
                                   want_alpha[b, :steps, :2 * n + 1], atol=1e-5, rtol=1e-5)


def test_backward_against_float64():
    lengths = INPUT_LENGTHS[:3] + [5]  # every sequence feasible: finite gradients
    nll, log_alpha = aten._ctc_loss.default(LOG_PROBS.double(), TARGETS, lengths,
                                            TARGET_LENGTHS, 0, True)
    grad = torch.randn(4, generator=torch.Generator().manual_seed(1))
    want = aten._ctc_loss_backward.default(grad.double(), LOG_PROBS.double(), TARGETS, lengths,
                                           TARGET_LENGTHS, nll, log_alpha, 0, True)
    got = ctc.ctc_loss_backward(to_jax(grad), to_jax(LOG_PROBS), to_jax(TARGETS), lengths,
                                TARGET_LENGTHS, None, None, 0, True)
    torch.testing.assert_close(torch.from_numpy(np.array(got)).double(), want, atol=2e-6,
                               rtol=2e-6)
