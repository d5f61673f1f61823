"""Activation checkpointing per decoder layer, applied from outside the model.

Like the sharding plans it is a transform of a plain model, kept beside them (the trainer and
``tpu-train plan`` both apply it). ``remat`` (``trainer.remat``) says what each layer keeps for
its backward; the rest is recomputed:

* ``full``: nothing but the layer's inputs;
* ``save_dots``: the results of its projections (matmuls without batch dimensions), so that
  its backward recomputes only norms, activations, RoPE and attention;
* ``save_qkv_proj``: the outputs of its attention's q, k and v projections (marked by forward
  hooks on those modules, :func:`tpu_train.compile.checkpointing.checkpoint_name`).

Each layer's ``forward`` becomes ``checkpoint(forward, context_fn=RematContext(remat))``: the
compiled step reads the policy from that call and differentiates the layer through
``jax.checkpoint`` with it; eager mode runs PyTorch's checkpoint, whose selective
checkpointing applies the same policy op by op (``mm``/``addmm`` outputs, the marked outputs).
"""

from __future__ import annotations

import functools

import torch

from tpu_train.compile.checkpointing import (QKV_NAMES, REMAT_POLICIES, RematContext,
                                             checkpoint_name, checkpointed_forward)

# The q/k/v projections of a layer's attention, by the module's own name: this project's
# Llama (wq, wk, wv) and Hugging Face's (q_proj, k_proj, v_proj).
_PROJECTION_NAMES = {"wq": QKV_NAMES[0], "wk": QKV_NAMES[1], "wv": QKV_NAMES[2],
                     "q_proj": QKV_NAMES[0], "k_proj": QKV_NAMES[1], "v_proj": QKV_NAMES[2]}


def _named_output(name: str, module, args, output):
    return checkpoint_name(output, name)


def _mark_projections(layer: torch.nn.Module) -> int:
    marked = 0
    for path, module in layer.named_modules():
        name = _PROJECTION_NAMES.get(path.rsplit(".", 1)[-1])
        if name is not None:
            module.register_forward_hook(functools.partial(_named_output, name))
            marked += 1
    return marked


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


def apply_activation_checkpointing(model: torch.nn.Module, remat: str = "full") -> int:
    """Recompute each block of ``model.layers`` in backward, keeping what ``remat`` says
    (module docstring); ``"none"`` leaves the model as it is.

    The block's ``forward`` is replaced on the instance, so parameter names (and checkpoints)
    are unchanged.  Returns the number of layers wrapped.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"trainer.remat={remat!r} is not a remat policy; choose one of "
                         f"{', '.join(REMAT_POLICIES)}")
    if remat == "none":
        return 0
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"activation checkpointing needs a non-empty `layers` ModuleList on "
            f"{type(model).__name__}; set trainer.remat=none"
        )
    if remat == "save_qkv_proj":
        for index, layer in enumerate(layers):
            if _mark_projections(layer) != 3:
                raise ValueError(
                    f"trainer.remat=save_qkv_proj needs one q, k and v projection module "
                    f"(wq/wk/wv or q_proj/k_proj/v_proj) in each layer; layer {index} of "
                    f"{type(model).__name__} has another set: choose trainer.remat=save_dots")
    context = RematContext(remat)
    for layer in layers:
        layer.forward = functools.partial(checkpointed_forward, context, layer.forward)
    return len(layers)
