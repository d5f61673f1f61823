"""How far the trainer's losses may be apart between two implementations: tests/tolerances'
``loss_atol`` for the debug_tiny Llama (tpu_train/models/config.py) and the base model the
fine-tuning recipes start from (tpu_train/assets/base_model), on the bundled task's 32-token
rows. The figures of the model's logits are measured on the CPU client by
tests/trainer/test_loss_bounds.py, which fails if they stop covering the model."""

from __future__ import annotations

import math

from tests.platforms import PLATFORM
from tests.tolerances import llama_functions, loss_atol

LAYERS, FFN_HIDDEN, VOCAB = 4, 768, 512
# The base model's logits on the bundled task (measured: RMS 8.5 - 9.2, max |z| 19.7 - 28.1 per
# 2-row batch), rounded up.
BASE_LOGIT_RMS = 10.0
BASE_LOGIT_MAX = 32.0
# Labelled (response) tokens per 32-token row of the bundled task, a lower bound (measured: 11
# or more per row, 22 - 28 per 2-row batch).
LABELLED_PER_ROW = 10


def base_model_loss_atol(rows: int, loss: float, steps: int = 1, platform: str = PLATFORM) -> float:
    """``loss_atol`` of the base model's mean loss over ``rows`` rows of the bundled task after
    ``steps`` steps (1: the forward alone)."""
    return loss_atol(reduction=FFN_HIDDEN, depth=LAYERS, functions=llama_functions(LAYERS),
                     logit_rms=BASE_LOGIT_RMS, logit_max=BASE_LOGIT_MAX, vocab=VOCAB,
                     tokens=rows * LABELLED_PER_ROW, loss=loss, steps=steps, platform=platform)


def assert_base_model_losses_close(got: list[float], want: list[float], rows: int,
                                   what: str = "loss") -> None:
    """Step i's loss (i = 1, 2, ...) within ``base_model_loss_atol(rows, want[i], i)``."""
    assert len(got) == len(want), (got, want)
    for step, (a, b) in enumerate(zip(got, want), start=1):
        atol = base_model_loss_atol(rows, b, step)
        assert math.isfinite(a) and abs(a - b) <= atol, \
            f"{what} at step {step}: {a!r} vs {b!r}, difference {abs(a - b):.2e} > {atol:.2e}"
