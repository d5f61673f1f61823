"""The causal-LM loss, the eager training step, and :class:`TrainStep`, which feeds either
step its layout's share of the batch (the compiled step is built by the layout).

Both steps have the signature ``step(micro_batches) -> dict[str, Tensor]`` with ``loss``,
``grad_norm``, ``lr`` (the lr used by this update) and ``finite`` (were the loss and the
gradient norm finite, i.e. was the update applied when skipping), so the loop does not care
which runs.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .config import Precision

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
    update (the gradients are dropped and the optimizer's step count does not advance; the
    schedule still advances so the lr stays aligned with the data). The trainer always skips:
    ``trainer.on_nan=stop`` then stops, so a non-finite update never reaches the parameters.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler, device: torch.device, precision: Precision,
                 max_grad_norm: float | None, skip_non_finite: bool,
                 data_parallel_size: int = 1, tensor_parallel_size: int = 1):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = device
        self.precision = precision
        self.max_grad_norm = max_grad_norm
        self.skip_non_finite = skip_non_finite
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.parameters = [p for p in model.parameters() if p.requires_grad]

    def _sum_over_processes(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the data-parallel ranks (each tensor-parallel group holds the
        same rows, so the sum over all processes counts every row ``tensor`` times)."""
        if self.data_parallel_size * self.tensor_parallel_size == 1:
            return value
        import torch.distributed as dist

        total = value.detach().to("cpu", torch.float64).reshape(1).clone()
        dist.all_reduce(total)
        return (total / self.tensor_parallel_size).reshape(())

    def __call__(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        self.model.train()
        lr = torch.tensor(self.optimizer.param_groups[0]["lr"])
        local_tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro_batches)
        # A Python float, not an int: a float is an input of the device's op executables, an
        # int a constant in them, which would make a new program for every batch's token count.
        total_tokens = float(max(int(self._sum_over_processes(torch.tensor(local_tokens))), 1))
        # FSDP averages gradients over the data-parallel ranks; each rank's share of the
        # global token-weighted loss is scaled up by their number to undo that mean.
        loss_total = torch.zeros((), device=self.device)
        for batch in micro_batches:
            with autocast_context(self.device, self.precision):
                loss_sum = causal_lm_loss_sum(self.model, batch)
            (loss_sum * self.data_parallel_size / total_tokens).backward()
            loss_total = loss_total + loss_sum.detach()
        loss = self._sum_over_processes(loss_total).float() / total_tokens
        # An infinite max norm measures without clipping (the scale factor is exactly 1).
        max_norm = float("inf") if self.max_grad_norm is None else self.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_norm)
        grad_norm = _whole(grad_norm)
        finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
        if finite or not self.skip_non_finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {"loss": loss, "grad_norm": grad_norm.detach(), "lr": lr,
                "finite": torch.tensor(finite)}


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A DTensor (the norm of sharded gradients) as an ordinary tensor."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


class TrainStep:
    """``step(host micro-batches) -> {"loss", "grad_norm", "lr"}`` in any layout.

    ``compiled`` is the ``CompiledTrainStep`` (None in eager mode); :meth:`place` puts its
    parameters and optimizer state where the layout runs it (before the first call, after a
    full resume).
    """

    def __init__(self, layout, run: Callable, compiled=None, host_batches: bool = False):
        self.layout = layout
        self.compiled = compiled
        self._run = run
        # ``run`` takes this process's rows on the host and transfers them itself.
        self._host_batches = host_batches

    def place(self) -> None:
        self.layout.place_step(self)

    def __call__(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> dict:
        return self._run(self.layout.place_batch(micro_batches, to_device=not self._host_batches))
