"""``_ctc_loss`` and its backward against CPU PyTorch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.ops.lowering_check import to_jax
from tests.platforms import PLATFORM
from tests.tolerances import function_ulps, unit_roundoff
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
    tol = 2e-6 + _excess_error(LOG_PROBS.shape[0], float(grad.abs().max()))
    torch.testing.assert_close(torch.from_numpy(np.array(got)).double(), want, atol=tol,
                               rtol=tol)


def _excess_error(steps: int, grad_max: float) -> float:
    """What the test platform's log and exp add to the gradients beyond the CPU client's
    (2e-6 there, measured), from tests/measured_ulps: each step of the alpha and beta
    recursions is a logsumexp of at most 3 terms, whose exps' relative error and log's
    absolute error, ulps * u * (1 + log 3), become an absolute error of the log-space
    values; those add up along the 2 x ``steps`` steps (the same approximation at every step:
    systematic), and a gradient, grad * (p - exp(alpha + beta - nll)), is off by that
    relative error of its probabilities, times |grad|. 0 on the CPU client."""
    def excess(name):
        return max(0.0, function_ulps(name, PLATFORM) - function_ulps(name, "cpu"))

    per_step = (excess("log") * (1 + math.log(3)) + excess("exp")) * unit_roundoff(torch.float32)
    return 2 * steps * per_step * grad_max
