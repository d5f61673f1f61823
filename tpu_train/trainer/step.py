"""Training steps: an eager PyTorch step, and the compiled one from ``tpu_train.compile``.

Both have the signature ``step(micro_batches) -> dict[str, Tensor]`` with ``loss``,
``grad_norm`` and ``lr`` (the lr used by this update), so the loop does not care which runs.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .config import Precision, StepMode
from .errors import ConfigError

IGNORE_INDEX = -100


def causal_lm_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over the non-ignored labels of ``batch``.

    Summing (rather than averaging) lets gradient accumulation divide by the token count of the
    whole step, which makes N micro-batches equivalent to one batch N times larger.
    """
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def causal_lm_loss_sum_and_count(model: torch.nn.Module,
                                 batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, number of non-ignored labels): the compiled step divides the sums of all
    micro-batches by their total count, the same token weighting as :class:`EagerStep`."""
    return causal_lm_loss_sum(model, batch), (batch["labels"] != IGNORE_INDEX).sum()


def autocast_context(device: torch.device, precision: Precision):
    """``torch.autocast`` in bfloat16 on ``device``'s type for ``bf16``; a no-op for fp32."""
    if precision is Precision.bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class EagerStep:
    """Forward, loss, backward over the micro-batches, clip, optimizer and scheduler step.

    With ``skip_non_finite`` a step whose loss or gradient norm is not finite applies no
    update (the gradients are dropped, the schedule still advances so the step count stays
    aligned with the data).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler, device: torch.device, precision: Precision,
                 max_grad_norm: float | None, skip_non_finite: bool):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = device
        self.precision = precision
        self.max_grad_norm = max_grad_norm
        self.skip_non_finite = skip_non_finite
        self.parameters = [p for p in model.parameters() if p.requires_grad]

    def __call__(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        self.model.train()
        lr = torch.tensor(self.optimizer.param_groups[0]["lr"])
        total_tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro_batches)
        total_tokens = max(total_tokens, 1)
        loss_total = torch.zeros((), device=self.device)
        for batch in micro_batches:
            with autocast_context(self.device, self.precision):
                loss_sum = causal_lm_loss_sum(self.model, batch)
            (loss_sum / total_tokens).backward()
            loss_total = loss_total + loss_sum.detach()
        loss = loss_total / total_tokens
        # An infinite max norm measures without clipping (the scale factor is exactly 1).
        max_norm = float("inf") if self.max_grad_norm is None else self.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_norm)
        finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
        if finite or not self.skip_non_finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {"loss": loss, "grad_norm": grad_norm.detach(), "lr": lr}


def build_train_step(mode: StepMode, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler, device: torch.device, precision: Precision,
                     max_grad_norm: float | None, grad_accum_steps: int,
                     skip_non_finite: bool) -> Callable:
    """The step for ``trainer.mode``; the compiled one needs ``tpu_train.compile``."""
    if mode is StepMode.eager:
        return EagerStep(model, optimizer, scheduler, device, precision, max_grad_norm,
                         skip_non_finite)
    try:
        from tpu_train.compile import compile_train_step
    except ImportError as exc:
        raise ConfigError(
            "trainer.mode=compiled needs tpu_train.compile.compile_train_step, which is not "
            f"available in this installation ({exc}); use trainer.mode=eager"
        ) from exc
    if skip_non_finite:
        raise ConfigError(
            "trainer.on_nan=skip is only supported with trainer.mode=eager (the compiled step "
            "applies its update inside one program); use trainer.on_nan=stop"
        )
    compiled = compile_train_step(model, optimizer, causal_lm_loss_sum_and_count,
                                  scheduler=scheduler, max_grad_norm=max_grad_norm,
                                  grad_accum_steps=grad_accum_steps)

    def step(micro_batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        # The compiled step accumulates internally: hand it the micro-batches joined.
        batch = {key: torch.cat([b[key] for b in micro_batches]) for key in micro_batches[0]}
        return compiled(batch)

    return step
