"""Context parallelism in a compiled SPMD step: sequences split over the mesh's ``context`` axis.

On a mesh whose ``context`` axis has ``N > 1`` devices, the step:

* permutes every ``[batch, seq]`` tensor of the batch into the zig-zag layout
  (:func:`tpu_train.ops.context_attention.zigzag_positions`: shard ``i`` holds chunks ``i``
  and ``2N - 1 - i`` of ``2N``) inside the traced loss, and adds ``position_ids``, each
  token's true position, so the model's rotary embedding follows the tokens;
* lowers the model's causal attention over that sequence as the per-shard attention of
  :mod:`tpu_train.ops.context_attention` (keys and values all-gathered over ``context``);
* pins the activations' sequence dimension to ``context`` (the plan's activation rule).

A summed or averaged token loss does not depend on the order of the tokens, so the step's loss
and gradients are those of the unpermuted batch. The loss function must pass the batch's
``position_ids`` to the model (the trainer's does); packed rows, which carry their own
``position_ids`` and ``segment_ids``, are refused, and so is a sliding window shorter than the
sequence (:func:`check_window`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Callable

import torch

from tpu_train.ops import context_attention

__all__ = ["AXIS", "ContextParallelError", "check_sequence", "check_window", "context_degree",
           "sequence_split", "zigzag_batch", "zigzag_loss"]

AXIS = "context"
PACKED_KEYS = ("position_ids", "segment_ids")


class ContextParallelError(ValueError):
    """A batch or setting context parallelism cannot run."""


def context_degree(mesh) -> int:
    """Devices each sequence is split over (1 without a mesh or a ``context`` axis)."""
    if mesh is None:
        return 1
    return int(dict(getattr(mesh, "jax_mesh", mesh).shape).get(AXIS, 1))


def _sequence_length(batch: Mapping[str, torch.Tensor]) -> int:
    tokens = batch.get("tokens") if isinstance(batch, Mapping) else None
    if tokens is None or tokens.dim() != 2:
        raise ContextParallelError(
            "context parallelism needs a batch dict with 'tokens' of shape [batch, seq]")
    return int(tokens.shape[1])


def check_sequence(seq_len: int, shards: int) -> None:
    if seq_len % (2 * shards):
        raise ContextParallelError(
            f"sequence length {seq_len} does not split into 2 x parallel.context = "
            f"{2 * shards} equal chunks (the zig-zag layout); make data.seq_len a multiple of "
            f"{2 * shards}")


def check_window(seq_len: int | None, shards: int, window: int | None) -> None:
    """A sliding window that cuts the sequence is applied as a mask over the tokens' order
    (not their ``position_ids``), which the zig-zag layout changes: refused, not miscomputed."""
    if shards > 1 and window is not None and seq_len is not None and seq_len > window:
        raise ContextParallelError(
            f"parallel.context={shards} cannot split sequences of {seq_len} tokens for a model "
            f"with a sliding window of {window} (its mask follows the tokens' order, which the "
            f"zig-zag layout changes); set parallel.context=1 or data.seq_len <= {window}")


def zigzag_batch(batch: Mapping[str, torch.Tensor], shards: int) -> dict[str, torch.Tensor]:
    """``batch`` with its ``[batch, seq]`` tensors in the zig-zag layout over ``shards``
    devices and ``position_ids`` (the tokens' positions) added; other entries unchanged."""
    packed = [k for k in PACKED_KEYS if k in batch]
    if packed:
        raise ContextParallelError(
            f"context parallelism does not take packed rows (the batch has {', '.join(packed)}); "
            f"set data.packing=false or parallel.context=1")
    seq = _sequence_length(batch)
    check_sequence(seq, shards)
    chunk = seq // (2 * shards)
    order = [c for i in range(shards) for c in (i, 2 * shards - 1 - i)]

    def permuted(x: torch.Tensor) -> torch.Tensor:
        # Slices and one concatenation: views of the (replicated) rows, no gather.
        return torch.cat([x[:, c * chunk:(c + 1) * chunk] for c in order], dim=1)

    out = {k: permuted(v) if isinstance(v, torch.Tensor) and v.dim() == 2 and
           v.shape[1] == seq else v for k, v in batch.items()}
    tokens = batch["tokens"]
    positions = torch.arange(seq, device=tokens.device).unsqueeze(0)
    out["position_ids"] = permuted(positions).expand(tokens.shape[0], seq)
    return out


def zigzag_loss(loss_fn: Callable, shards: int) -> Callable:
    """``loss_fn(model, batch)`` run on :func:`zigzag_batch` of the batch."""

    def loss(model, batch):
        return loss_fn(model, zigzag_batch(batch, shards))

    loss.__wrapped__ = loss_fn
    return loss


def sequence_split(mesh, batch_shapes, window: int | None = None
                   ) -> contextlib.AbstractContextManager:
    """The attention lowering's view of the split (:func:`context_attention.sequence_split`)
    for a step over ``batch_shapes`` (the first ``[batch, seq]`` one gives the length) of a
    model with a sliding ``window`` (None: none)."""
    shards = context_degree(mesh)
    if shards == 1:
        return contextlib.nullcontext()
    seq = next((int(s[1]) for s in batch_shapes if len(s) == 2), None)
    if seq is None:
        raise ContextParallelError("context parallelism needs a [batch, seq] batch tensor")
    check_sequence(seq, shards)
    check_window(seq, shards, window)
    return context_attention.sequence_split(getattr(mesh, "jax_mesh", mesh), seq, AXIS)

