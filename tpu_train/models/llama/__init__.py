"""The Llama family: the model (``model``), its config and named sizes (``config``), RoPE
(``rope``), the KV cache (``kv_cache``), the Hugging Face format (``hf``) and its
:class:`~tpu_train.models.ModelFamily` (``spec``: ``LLAMA``).

Names load on first use, so that reading a config or the family's spec imports no torch.
"""

import importlib

_SOURCES = {
    "CONFIGS": "config", "LlamaConfig": "config", "RopeScaling": "config",
    "flops_per_token": "config", "get_config": "config", "num_params": "config",
    "param_shapes": "config",
    "config_from_hf": "hf", "config_to_hf": "hf", "from_pretrained": "hf", "hf_name": "hf",
    "read_config": "hf", "save_pretrained": "hf",
    "KVCache": "kv_cache", "StaticKVCache": "kv_cache",
    "Attention": "model", "FeedForward": "model", "Llama": "model", "RMSNorm": "model",
    "TransformerBlock": "model", "init_weights": "model",
    "apply_rotary": "rope", "inverse_frequencies": "rope", "rope_tables": "rope",
    "LLAMA": "spec",
}

__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
