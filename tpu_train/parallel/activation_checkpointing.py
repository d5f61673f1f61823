"""Activation checkpointing per decoder layer, applied from outside the model.

Like the sharding plans it is a transform of a plain model, kept beside them (the trainer and
``tpu-train plan`` both apply it).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: torch.nn.Module) -> int:
    """Recompute each block of ``model.layers`` in backward instead of storing its activations.

    The block's ``forward`` is replaced on the instance, so parameter names (and checkpoints)
    are unchanged.  Returns the number of layers wrapped.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"activation checkpointing needs a non-empty `layers` ModuleList on "
            f"{type(model).__name__}; set trainer.activation_checkpointing=false"
        )
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, layer.forward)
    return len(layers)
