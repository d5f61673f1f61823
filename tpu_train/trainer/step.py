"""The causal-LM loss, the eager training step, and :class:`TrainStep`, which feeds either
step its layout's share of the batch (the compiled step is built by the layout).

Both steps have the signature ``step(micro_batches) -> dict[str, Tensor]`` with ``loss``,
``grad_norm``, ``lr`` (the lr used by this update) and ``finite`` (were the loss and the
gradient norm finite, i.e. was the update applied when skipping), so the loop does not care
which runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from tpu_train.compile.cross_entropy import linear_cross_entropy_sum

from .config import Precision

IGNORE_INDEX = -100
# Batch keys passed to the model as keyword arguments when a batch has them (packed rows with
# document masking: tpu_train.data.packing).
MODEL_INPUTS = ("position_ids", "segment_ids")


def causal_lm_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over the non-ignored labels of ``batch``.

    Summing (rather than averaging) lets gradient accumulation divide by the token count of the
    whole step, which makes N micro-batches equivalent to one batch N times larger.
    """
    inputs = {key: batch[key] for key in MODEL_INPUTS if key in batch}
    weight = output_weight(model)
    if weight is not None:
        hidden = model.hidden_states(batch["tokens"], **inputs)
        return linear_cross_entropy_sum(hidden, weight, batch["labels"],
                                        ignore_index=IGNORE_INDEX)
    logits = model(batch["tokens"], **inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def output_weight(model: torch.nn.Module) -> torch.Tensor | None:
    """The weight of ``model``'s output layer where the loss can take the model's final hidden
    states and this weight (:func:`~tpu_train.compile.cross_entropy.linear_cross_entropy_sum`,
    which never holds the full float32 logits): a model with ``hidden_states`` whose output
    is a plain bias-free ``nn.Linear`` or the tied embedding. None for any other model, and
    where the weight is a DTensor (FSDP2 / tensor parallelism per device: their module hooks
    gather it around ``forward``): the loss then takes the logits."""
    from torch.distributed.tensor import DTensor

    if not callable(getattr(model, "hidden_states", None)):
        return None
    output = getattr(model, "output", None)
    if output is None:
        embeddings = getattr(model, "tok_embeddings", None)
        weight = getattr(embeddings, "weight", None) if type(embeddings) is torch.nn.Embedding \
            else None
    elif type(output) is torch.nn.Linear and output.bias is None:
        weight = output.weight
    else:
        weight = None
    return None if weight is None or isinstance(weight, DTensor) else weight


def training_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`causal_lm_loss_sum`, plus the model's auxiliary loss where it has one (a
    Mixtral's load-balancing loss, weighted by its ``aux_loss_weight``) counted once per
    label, so that dividing by the token count gives ``cross-entropy + weight * aux`` (what
    transformers' ``MixtralForCausalLM`` returns as its loss with router logits on)."""
    weight = getattr(model, "aux_loss_weight", 0.0)
    if not weight:
        return causal_lm_loss_sum(model, batch)
    inputs = {key: batch[key] for key in MODEL_INPUTS if key in batch}
    logits, aux_loss = model(batch["tokens"], return_aux_loss=True, **inputs)
    labels = batch["labels"].flatten()
    cross_entropy = F.cross_entropy(logits.float().flatten(0, 1), labels,
                                    ignore_index=IGNORE_INDEX, reduction="sum")
    return cross_entropy + weight * aux_loss.float() * (labels != IGNORE_INDEX).sum()


def causal_lm_loss_sum_and_count(model: torch.nn.Module,
                                 batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed training loss, number of non-ignored labels): the compiled step divides the sums
    of all micro-batches by their total count, the same token weighting as :class:`EagerStep`."""
    return training_loss_sum(model, batch), (batch["labels"] != IGNORE_INDEX).sum()


def autocast_context(device: torch.device, precision: Precision):
    """``torch.autocast`` in bfloat16 on ``device``'s type for ``bf16``; a no-op for fp32."""
    if precision is Precision.bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class EagerStepSettings:
    """What an :class:`EagerStep` does besides forward and backward: ``precision`` (bf16:
    forward and loss under autocast), clipping to ``max_grad_norm`` (None: measure only),
    ``grad_accum_steps`` micro-batches per step, skipping non-finite updates, and the
    data- / tensor-parallel sizes of a per-device layout."""

    precision: Precision
    max_grad_norm: float | None
    grad_accum_steps: int = 1
    skip_non_finite: bool = True
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1


class EagerStep:
    """Forward, loss, backward over the micro-batches, clip, optimizer and scheduler step.

    A call takes this process's rows of one global step on the host and splits them into
    ``grad_accum_steps`` consecutive micro-batches (the one place they are split), each moved
    to ``device`` when its turn comes. With ``skip_non_finite`` a step whose loss or gradient
    norm is not finite applies no update (the gradients are dropped and the optimizer's step
    count does not advance; the schedule still advances so the lr stays aligned with the
    data). The trainer always skips: ``trainer.on_nan=stop`` then stops, so a non-finite
    update never reaches the parameters.
    """

    def __init__(self, trained: tuple, device: torch.device, settings: EagerStepSettings):
        self.model, self.optimizer, self.scheduler = trained
        self.device = device
        self.precision = settings.precision
        self.max_grad_norm = settings.max_grad_norm
        self.grad_accum_steps = settings.grad_accum_steps
        self.skip_non_finite = settings.skip_non_finite
        self.data_parallel_size = settings.data_parallel_size
        self.tensor_parallel_size = settings.tensor_parallel_size
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]

    def micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """``batch`` as ``grad_accum_steps`` consecutive micro-batches (host views)."""
        if self.grad_accum_steps == 1:
            return [batch]
        parts = {k: v.chunk(self.grad_accum_steps) for k, v in batch.items()}
        return [{k: chunks[i] for k, chunks in parts.items()}
                for i in range(self.grad_accum_steps)]

    def _sum_over_processes(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the data-parallel ranks (each tensor-parallel group holds the
        same rows, so the sum over all processes counts every row ``tensor`` times)."""
        if self.data_parallel_size * self.tensor_parallel_size == 1:
            return value
        import torch.distributed as dist

        total = value.detach().to("cpu", torch.float64).reshape(1).clone()
        dist.all_reduce(total)
        return (total / self.tensor_parallel_size).reshape(())

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.model.train()
        micro_batches = self.micro_batches(batch)
        lr = torch.tensor(self.optimizer.param_groups[0]["lr"])
        local_tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro_batches)
        # A Python float, not an int: a float is an input of the device's op executables, an
        # int a constant in them, which would make a new program for every batch's token count.
        total_tokens = float(max(int(self._sum_over_processes(torch.tensor(local_tokens))), 1))
        # FSDP averages gradients over the data-parallel ranks; each rank's share of the
        # global token-weighted loss is scaled up by their number to undo that mean.
        loss_total = torch.zeros((), device=self.device)
        for batch in micro_batches:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with autocast_context(self.device, self.precision):
                loss_sum = training_loss_sum(self.model, batch)
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
    """``step(global batch) -> {"loss", "grad_norm", "lr", ...}`` in any layout.

    The global batch holds the step's ``grad_accum_steps`` micro-batches one after the other;
    the layout picks this process's rows (:meth:`~tpu_train.trainer.layouts.Layout.place_batch`)
    and ``run``, the step that accumulates, splits them. ``compiled`` is the
    ``CompiledTrainStep`` (None in eager mode); :meth:`place` puts its parameters and optimizer
    state where the layout runs it (before the first call, after a full resume). A call takes
    the batch on the host, or as :meth:`put_batch` placed it before.
    """

    def __init__(self, layout, run: Callable, compiled=None, grad_accum_steps: int = 1):
        self.layout = layout
        self.compiled = compiled
        self.grad_accum_steps = grad_accum_steps
        self._run = run

    def place(self) -> None:
        self.layout.place_step(self)

    def put_batch(self, batch: dict[str, torch.Tensor]) -> "PlacedBatch":
        """``batch`` (on the host) placed as a call reads it: this process's rows, and for the
        compiled step on the device
        (:meth:`~tpu_train.compile.CompiledTrainStep.put_batch`), so that a batch put while
        the previous step runs is there when its call comes."""
        placed = self.layout.place_batch(batch, self.grad_accum_steps)
        if self.compiled is not None:
            placed = self.compiled.put_batch(placed)
        return PlacedBatch(placed)

    def compile_ahead(self, batch: dict[str, torch.Tensor]) -> bool:
        """Trace and lower the compiled step for batches like ``batch`` (placed as
        :meth:`put_batch` places them, as the loop's are) now and start XLA's compile of it on
        a thread of its own (:meth:`~tpu_train.compile.CompiledTrainStep.compile_ahead`); the
        first call waits for it. False in eager mode, where there is nothing to compile."""
        if self.compiled is None:
            return False
        return self.compiled.compile_ahead(self.put_batch(batch).tensors)

    def __call__(self, batch) -> dict:
        if not isinstance(batch, PlacedBatch):
            batch = PlacedBatch(self.layout.place_batch(batch, self.grad_accum_steps))
        return self._run(batch.tensors)


@dataclasses.dataclass(frozen=True)
class PlacedBatch:
    """A global batch as :meth:`TrainStep.put_batch` placed it."""

    tensors: dict


class BatchesAhead:
    """The loop's global batches, each placed as the step reads it
    (:meth:`TrainStep.put_batch`), the next one while the current step runs.

    The loop calls :meth:`put_next` once a step is dispatched and before it reads the step's
    loss, so the next batch's transfer overlaps the program. :meth:`state_dict` is the data
    position after the last batch :meth:`next` returned: a batch put ahead and not trained on
    is read again after a resume. An error reading the next batch (the end of the data too)
    is raised by the :meth:`next` that would have returned it."""

    def __init__(self, batches, step: TrainStep, micro_batches: int):
        self._batches = batches  # the loader or its prefetcher, for state_dict()
        self._iterator = iter(batches)
        self._step = step
        self._micro_batches = micro_batches
        self._ahead: tuple | BaseException | None = None
        self._position: Any = None

    def _read(self) -> tuple:
        batch = join_micro_batches([next(self._iterator)
                                    for _ in range(self._micro_batches)])
        return self._step.put_batch(batch), self._source_position()

    def _source_position(self) -> Any:
        try:
            return self._batches.state_dict()
        except (AttributeError, TypeError) as error:  # a source that cannot be resumed
            return error

    def put_next(self) -> None:
        try:
            self._ahead = self._read()
        except Exception as error:  # noqa: BLE001 - raised by next(), where the loop reads
            self._ahead = error

    def next(self) -> PlacedBatch:
        ahead, self._ahead = self._ahead, None
        if isinstance(ahead, BaseException):
            raise ahead
        batch, self._position = ahead if ahead is not None else self._read()
        return batch

    def state_dict(self) -> Any:
        if self._position is None:
            return self._batches.state_dict()
        if isinstance(self._position, BaseException):
            raise self._position
        return self._position


def join_micro_batches(micro_batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One global step's batch from the loader's consecutive micro-batches (joined on the
    host, where it costs no device program)."""
    if len(micro_batches) == 1:
        return micro_batches[0]
    return {k: torch.cat([b[k] for b in micro_batches]) for k in micro_batches[0]}
