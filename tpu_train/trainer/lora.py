"""LoRA for recipes: :mod:`tpu_train.models.lora` (plain PyTorch, so that the planner, below
the trainer, builds the same adapted and quantized model)."""

from tpu_train.models.lora import (Int8Linear, LoRALinear, adapters_state, apply_lora,
                                   has_int8_base, load_adapters_state, merge_lora,
                                   quantize_frozen_linears, quantize_rows,
                                   store_frozen_floats)

__all__ = ["Int8Linear", "LoRALinear", "adapters_state", "apply_lora", "has_int8_base",
           "load_adapters_state", "merge_lora", "quantize_frozen_linears", "quantize_rows",
           "store_frozen_floats"]
