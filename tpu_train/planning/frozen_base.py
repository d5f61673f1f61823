"""What a LoRA run holds per chip: a frozen base (in its own dtype, int8 under
``model.base_dtype=int8``) and the adapters, the only weights with gradients and optimizer
state (``tpu_train.models.lora``).

:func:`frozen_base_of` reads it from a composed config; :func:`weight_bytes` counts the bytes
the estimate (:mod:`.estimate`) puts in place of a full fine-tune's weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tpu_train.models import family_of

# The recipe whose model trains adapters only (recipes/llama_lora.py, recipe.lora.*).
LORA_RECIPE = "llama_lora"
_LINEAR_SUFFIX = ".weight"


@dataclasses.dataclass(frozen=True)
class FrozenBase:
    """A frozen base with adapters of ``rank`` on the linear layers named ``targets``.
    ``int8``: every frozen linear weight in int8 with a float32 scale per output row;
    ``float_bytes``: bytes of each other frozen value (embeddings, norms; under ``int8`` the
    untrained linears too, when not quantized)."""

    rank: int
    targets: tuple[str, ...]
    int8: bool
    float_bytes: int


def _is_linear(name: str, shape: tuple) -> bool:
    return len(shape) == 2 and not name.startswith("tok_embeddings")


def weight_bytes(cfg: Any, base: FrozenBase, param_bytes: int) -> tuple[int, int, int]:
    """``(frozen bytes, adapter elements, all elements)`` of the whole model: the frozen
    weights as stored, the adapters (``rank x in + out x rank`` per targeted linear, trained
    in ``param_bytes``), and the base's element count (for the per-chip share)."""
    frozen = adapters = elements = 0
    for name, shape in family_of(cfg).param_shapes(cfg).items():
        elements += _count(shape)
        module = name.removesuffix(_LINEAR_SUFFIX).rsplit(".", 1)[-1]
        if _is_linear(name, shape) and module in base.targets:
            adapters += base.rank * (shape[0] + shape[1])
        if _is_linear(name, shape) and base.int8:
            frozen += _count(shape) + 4 * shape[0]  # int8 values, a float32 scale per row
        else:
            frozen += _count(shape) * base.float_bytes
    return frozen, adapters, elements


def _count(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def frozen_base_of(config: Any, param_bytes: int, compute_bytes: int | None,
                   changes: dict | None = None) -> FrozenBase | None:
    """The composed config's frozen base, or None where every weight trains (a recipe other
    than ``llama_lora``). Under ``model.base_dtype=int8`` the other frozen values are stored
    in the compute dtype (``compute_bytes``: 2 under ``trainer.precision=bf16``) or
    ``trainer.param_dtype``, whichever is narrower, as the trainer stores them."""
    from .estimate import setting

    if setting(config, "recipe.name", changes) != LORA_RECIPE:
        return None
    dtype = setting(config, "model.base_dtype", changes)
    int8 = getattr(dtype, "value", dtype) == "int8"
    float_bytes = min(param_bytes, compute_bytes or 4) if int8 else param_bytes
    targets = tuple(setting(config, "recipe.lora.targets", changes) or ())
    return FrozenBase(int(setting(config, "recipe.lora.rank", changes)), targets, int8,
                      float_bytes)


def analysis_args(base: FrozenBase | None) -> dict[str, Any]:
    """What the analysis child needs to build the same model (:func:`adapt_meta_model`)."""
    if base is None:
        return {}
    return {"lora": {"rank": base.rank, "targets": list(base.targets), "int8": base.int8}}


def adapt_meta_model(model, lora: dict | None, compute_dtype) -> None:
    """Apply the run's adapters (and int8 base) to the planner's ``meta`` model, as the
    trainer does (``tpu_train.trainer.setup.store_frozen_base``)."""
    if not lora:
        return
    from tpu_train.models.lora import apply_lora, quantize_frozen_linears, store_frozen_floats

    apply_lora(model, list(lora["targets"]), int(lora["rank"]), 2.0 * int(lora["rank"]))
    if lora.get("int8"):
        quantize_frozen_linears(model)
        if compute_dtype is not None:
            store_frozen_floats(model, compute_dtype)
