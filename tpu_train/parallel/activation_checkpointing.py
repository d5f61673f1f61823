"""Activation checkpointing per decoder layer, applied from outside the model.

Like the sharding plans it is a transform of a plain model, kept beside them (the trainer and
``tpu-train plan`` both apply it). ``remat`` (``trainer.remat``) says what each layer keeps for
its backward; the rest is recomputed:

* ``full``: nothing but the layer's inputs;
* ``save_dots``: the results of its projections (matmuls without batch dimensions), so that
  its backward recomputes only norms, activations, RoPE and attention;
* ``save_qkv_proj``: the outputs of its attention's q, k and v projections (marked by forward
  hooks on those modules, :func:`tpu_train.compile.remat_regions.checkpoint_name`), which the
  model family names (``ModelFamily.qkv_projections``).

Which modules are the layers is the family's too (``ModelFamily.blocks``); the caller passes
both, as this layer knows no family.

Each layer's ``forward`` becomes ``checkpoint(forward, context_fn=RematContext(remat))``: the
compiled step reads the policy from that call and differentiates the layer through
``jax.checkpoint`` with it; eager mode runs PyTorch's checkpoint, whose selective
checkpointing applies the same policy op by op (``mm``/``addmm`` outputs, the marked outputs).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from tpu_train.compile.remat_regions import (QKV_NAMES, REMAT_POLICIES, RematContext,
                                             checkpoint_name, checkpointed_forward)


def _named_output(name: str, module, args, output):
    return checkpoint_name(output, name)


def _mark_projections(layer: torch.nn.Module, paths: Sequence[str]) -> str | None:
    """Mark the outputs of ``layer``'s q, k and v projections (module ``paths`` within it);
    returns the first path the layer does not have (None: all marked)."""
    modules = dict(layer.named_modules())
    missing = next((p for p in paths if p not in modules), None)
    if missing is None:
        for path, name in zip(paths, QKV_NAMES):
            modules[path].register_forward_hook(functools.partial(_named_output, name))
    return missing


def remat_setting(remat, activation_checkpointing: bool = False) -> str:
    """The policy of ``trainer.remat`` (an enum member or its name) and
    ``trainer.activation_checkpointing``, the older switch, which means ``full``."""
    remat = getattr(remat, "value", remat)
    if remat not in REMAT_POLICIES:
        raise ValueError(f"trainer.remat={remat!r} is not a remat policy; choose one of "
                         f"{', '.join(REMAT_POLICIES)}")
    if activation_checkpointing:
        if remat not in ("none", "full"):
            raise ValueError(f"trainer.activation_checkpointing=true means trainer.remat=full, "
                             f"but trainer.remat={remat}; set only trainer.remat")
        return "full"
    return remat


def apply_activation_checkpointing(model: torch.nn.Module, remat: str = "full", *,
                                   blocks: Sequence[torch.nn.Module] | None = None,
                                   qkv_projections: Sequence[str] | None = None) -> int:
    """Recompute each of ``blocks`` (default: ``model.layers``) in backward, keeping what
    ``remat`` says (module docstring); ``"none"`` leaves the model as it is.

    ``qkv_projections``: the module paths, within each block, of its q, k and v projections
    (the family's ``qkv_projections``), which ``save_qkv_proj`` needs. The block's ``forward``
    is replaced on the instance, so parameter names (and checkpoints) are unchanged. Returns
    the number of layers wrapped.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"trainer.remat={remat!r} is not a remat policy; choose one of "
                         f"{', '.join(REMAT_POLICIES)}")
    if remat == "none":
        return 0
    layers = getattr(model, "layers", None) if blocks is None else blocks
    if not isinstance(layers, (torch.nn.ModuleList, list, tuple)) or len(layers) == 0:
        raise ValueError(
            f"activation checkpointing needs the repeated blocks of {type(model).__name__} "
            f"(its family's blocks, or a non-empty `layers` ModuleList); set trainer.remat=none"
        )
    if remat == "save_qkv_proj":
        if not qkv_projections:
            raise ValueError(f"trainer.remat=save_qkv_proj needs the q, k and v projections of "
                             f"{type(model).__name__}'s layers, which its model family does not "
                             "name: choose trainer.remat=save_dots")
        for index, layer in enumerate(layers):
            missing = _mark_projections(layer, qkv_projections)
            if missing is not None:
                raise ValueError(
                    f"trainer.remat=save_qkv_proj marks the q, k and v projections "
                    f"{', '.join(qkv_projections)} of each layer; layer {index} of "
                    f"{type(model).__name__} has no {missing}: choose trainer.remat=save_dots")
    context = RematContext(remat)
    for layer in layers:
        layer.forward = functools.partial(checkpointed_forward, context, layer.forward)
    return len(layers)
