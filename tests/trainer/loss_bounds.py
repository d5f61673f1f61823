"""How far the trainer's losses may be apart between two implementations: tests/tolerances'
``loss_atol`` for the debug_tiny Llama (tpu_train/models/llama/config.py) and the base model the
fine-tuning recipes start from (tpu_train/assets/base_model), on the bundled task's 32-token
rows. The figures of the model's logits are measured on the CPU client by
tests/trainer/test_loss_bounds.py, which fails if they stop covering the model."""

from __future__ import annotations

import math

import pytest
import torch

from tests.platforms import PLATFORM
from tests.tolerances import cross_entropy_atol, llama_functions, loss_atol, loss_rtol, rtol_for

LAYERS, FFN_HIDDEN, VOCAB = 4, 768, 512
# The base model's logits on the bundled task (measured: RMS 8.5 - 9.2, max |z| 19.7 - 28.1 per
# 2-row batch), rounded up.
BASE_LOGIT_RMS = 10.0
BASE_LOGIT_MAX = 32.0
# Labelled (response) tokens per 32-token row of the bundled task, a lower bound (measured: 11
# or more per row, 22 - 28 per 2-row batch).
LABELLED_PER_ROW = 10
# ||P|| / ||P - Y|| of a 2-row batch (P the labelled positions' softmax, Y their one-hot labels):
# how much a relative error of the probabilities magnifies in the loss's gradient, where the
# model predicts its labels well (measured: up to 3.5 over the first 2-row batches), rounded up.
BASE_SOFTMAX_RATIO = 5.0


def medium_matmuls(platform: str = PLATFORM) -> torch.dtype:
    """What ``trainer.matmul_precision=medium`` (debug_tiny_base's setting) rounds float32 dots'
    operands to: one bfloat16 pass on a TPU, nothing on the CPU client (exact there)."""
    return torch.bfloat16 if platform == "tpu" else torch.float32


def base_model_loss_atol(rows: int, loss: float, steps: int = 1, platform: str = PLATFORM,
                         matmul_dtype: torch.dtype | None = None) -> float:
    """``loss_atol`` of the base model's mean loss over ``rows`` rows of the bundled task after
    ``steps`` steps (1: the forward alone), one side's dots rounding their operands to
    ``matmul_dtype``: by default debug_tiny_base's ``matmul_precision=medium`` on the platform
    against torch's exact float32 on the CPU; float32 where both sides round alike (two runs at
    the same precision on one platform: the same operands round the same way)."""
    if matmul_dtype is None:
        matmul_dtype = medium_matmuls(platform)
    return loss_atol(reduction=FFN_HIDDEN, depth=LAYERS, functions=llama_functions(LAYERS),
                     logit_rms=BASE_LOGIT_RMS, logit_max=BASE_LOGIT_MAX, vocab=VOCAB,
                     tokens=rows * LABELLED_PER_ROW, loss=loss, steps=steps,
                     matmul_dtype=matmul_dtype, platform=platform)


def base_model_grad_norm_rtol(steps: int, platform: str = PLATFORM) -> float:
    """Relative difference of the base model's gradient norm after ``steps`` steps between two
    runs at the same matmul precision on one platform (their dots' operands round alike): the
    forward and backward chain (``rtol_for``, twice the depth and the functions) and the
    softmax's: its probabilities p = exp(z - lse) take the logsumexp's absolute error
    (``cross_entropy_atol`` of one token) as a relative error, magnified in the gradient P - Y
    by BASE_SOFTMAX_RATIO; linear in the steps."""
    chain = rtol_for(torch.float32, FFN_HIDDEN, 2 * LAYERS, 2 * llama_functions(LAYERS),
                     platform)
    softmax = BASE_SOFTMAX_RATIO * cross_entropy_atol(VOCAB, BASE_LOGIT_MAX, 1, platform)
    return max(steps, 1) * (chain + softmax)


def assert_base_model_losses_close(got: list[float], want: list[float], rows: int,
                                   what: str = "loss", trained: bool = True,
                                   matmul_dtype: torch.dtype | None = None) -> None:
    """The i-th loss (i = 1, 2, ...) within ``base_model_loss_atol(rows, want[i], i)``: step i
    of a training run where both sides trained; ``trained=False`` where only the losses'
    evaluation differs (the same parameters on both sides), each a forward alone;
    ``matmul_dtype`` as :func:`base_model_loss_atol`'s."""
    assert len(got) == len(want), (got, want)
    for index, (a, b) in enumerate(zip(got, want), start=1):
        atol = base_model_loss_atol(rows, b, index if trained else 1, matmul_dtype=matmul_dtype)
        assert math.isfinite(a) and abs(a - b) <= atol, \
            f"{what} {index}: {a!r} vs {b!r}, difference {abs(a - b):.2e} > {atol:.2e}"


# The overrides of a run whose losses are compared with the golden files. Those were written on
# the CPU client, where trainer.matmul_precision=medium (the recipes' setting) still computes
# float32 dots exactly; on a TPU medium is one bfloat16 pass, whose rounding would dominate the
# bound (about 15x the float32 one) and hide what the comparison is for, the implementation.
GOLDEN_OVERRIDES = () if PLATFORM == "cpu" else ("trainer.matmul_precision=highest",)


def assert_matches_golden(losses: list[float], golden: list[float], rows: int) -> None:
    """A recipe's losses against its golden file (tests/trainer/golden, written on the CPU
    client), from a run with GOLDEN_OVERRIDES. On the CPU client a regression check as tight as
    its own rounding: fp32 rounding of the steps of debug_tiny (longest reduction the 768-wide
    feed-forward, 4 layers deep), relative, as the golden values were written there. On another
    platform the golden values are another implementation's: within the derived cross-platform
    bound, both sides' dots in float32."""
    if PLATFORM == "cpu":
        assert losses == pytest.approx(
            golden, rel=loss_rtol(torch.float32, len(golden), reduction=FFN_HIDDEN, depth=LAYERS))
    else:
        assert_base_model_losses_close(losses, golden, rows, "loss against the golden file",
                                       matmul_dtype=torch.float32)
