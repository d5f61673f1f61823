"""The Mixtral family: the model (``model``), the mixture of experts (``moe``), its config and
named sizes (``config``), the Hugging Face format (``hf``) and its
:class:`~tpu_train.models.ModelFamily` (``spec``: ``MIXTRAL``).

Names load on first use, so that reading a config or the family's spec imports no torch.
"""

import importlib

_SOURCES = {
    "CONFIGS": "config", "MOE_IMPLS": "config", "MixtralConfig": "config",
    "flops_per_token": "config", "param_shapes": "config",
    "MixtralTensorNames": "hf", "config_from_hf": "hf", "config_to_hf": "hf",
    "from_pretrained": "hf", "read_config": "hf", "save_pretrained": "hf",
    "Mixtral": "model", "MixtralBlock": "model",
    "MoEFeedForward": "moe", "grouped_matmul": "moe", "load_balancing_loss": "moe",
    "route": "moe",
    "MIXTRAL": "spec",
}

__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
