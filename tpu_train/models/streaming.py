"""A frozen int8 base built on the host a piece at a time, never whole in a float dtype.

The model is first laid out on the ``meta`` device exactly as it will be stored: adapted
(LoRA), its frozen linear weights int8 with float32 scales
(:func:`~tpu_train.models.lora.quantize_frozen_linears` on ``meta`` tensors), its other frozen
weights in their storage dtype (:func:`~tpu_train.models.lora.store_frozen_floats`).
:func:`materialize_quantized` then allocates that model once (the int8 model's own size) and
writes the base's values into it as they come, from a seeded initialization
(``ModelFamily.initial_values``) or a Hugging Face checkpoint read tensor by tensor
(``HfFormat.read_weights``): each value is rounded to the dtype the base is quantized from
(bfloat16, as a checkpoint stores it) and, for a frozen linear weight, quantized by rows
there and then. What is alive besides the model is one checkpoint tensor or one piece of an
initialization, and its quantization's temporaries (bounded by
:data:`~tpu_train.models.lora.QUANTIZE_PIECE_ELEMENTS`). The values are those of building the
whole model in bfloat16 and quantizing it afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .lora import Int8Linear, LoRALinear, quantize_rows

__all__ = ["QuantizedWriter", "materialize_quantized"]


class QuantizedWriter:
    """Writes base values into a materialized model laid out for an int8 base: a frozen linear
    weight quantized (its rows, with their scales), any other parameter converted."""

    def __init__(self, model: nn.Module, source_dtype: torch.dtype = torch.bfloat16):
        self.source_dtype = source_dtype
        self.params = dict(model.named_parameters())
        # "<module>.weight" of every int8 weight -> the module holding it and its scale.
        self.quantized = {f"{name}.weight" if name else "weight": module
                          for name, module in model.named_modules()
                          if _holds_int8_weight(module)}

    @torch.no_grad()
    def write(self, name: str, index, value: torch.Tensor) -> None:
        """Store ``value`` as parameter ``name`` (``index``: None for all of it, else an int or
        a slice of its first dimension)."""
        value = value.to(self.source_dtype)
        module = self.quantized.get(name)
        if module is None:
            target = self.params[name]
            (target if index is None else target[index]).copy_(value)
            return
        q, scale = quantize_rows(value)
        if index is None:
            module.weight.copy_(q)
            module.weight_scale.copy_(scale)
        else:
            module.weight[index] = q
            module.weight_scale[index] = scale


def _holds_int8_weight(module: nn.Module) -> bool:
    return isinstance(module, Int8Linear) or (isinstance(module, LoRALinear)
                                             and module.weight_scale is not None)


def materialize_quantized(model: nn.Module, base_names: Iterable[str],
                          values: Iterable[tuple], device: torch.device | str = "cpu",
                          source_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Allocate ``model`` (on ``meta``, laid out as stored) on ``device`` and fill it.

    ``values`` yields ``(name, index or None, tensor)`` for the parameters ``base_names`` (the
    model's own before it was adapted; several pieces of one are fine); every other parameter
    but the int8 weights' scales (the adapters) is given its module's ``reset_parameters()``,
    in module order, as construction would have; the RoPE tables are recomputed. A parameter
    that neither gets is a ``TypeError`` naming it."""
    base = set(base_names)
    model.to_empty(device=device)
    writer = QuantizedWriter(model, source_dtype)
    _reset_added_parameters(model, base)
    for name, index, value in values:
        writer.write(name, index, value)
    if hasattr(model, "reset_rope_tables"):
        model.reset_rope_tables()
    return model


def _reset_added_parameters(model: nn.Module, base: set[str]) -> None:
    for module_name, module in model.named_modules():
        added = [f"{module_name}.{name}" if module_name else name
                 for name, _ in module.named_parameters(recurse=False)
                 if name != "weight_scale"]
        added = [name for name in added if name not in base]
        if not added:
            continue
        if not hasattr(module, "reset_parameters"):
            raise TypeError(
                f"parameter {added[0]!r} was added to the model on the meta device by a module "
                f"({type(module).__name__}) without reset_parameters(), which would give it its "
                "initial values; give the module one")
        module.reset_parameters()
