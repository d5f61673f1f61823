"""The Mixtral family: what the trainer, the parallel plans and the planner need of it
(:class:`tpu_train.models.ModelFamily`).

Parameter roles: Llama's for attention, norms, embeddings and head (the same module names),
and for each layer's mixture:

==============================  ==============  ==============================================
parameter                       role            why
==============================  ==============  ==============================================
``feed_forward.gate.weight``    replicated      the router, ``[n_experts, dim]``: tiny
``feed_forward.w{1,3}``         expert_column   ``[n_experts, hidden, dim]``: experts over
                                                ``expert``, hidden units over ``tensor``
``feed_forward.w2``             expert_row      ``[n_experts, dim, hidden]``
==============================  ==============  ==============================================

Module-level torch-free, like Llama's spec.
"""

from __future__ import annotations

from typing import Any

from ..llama.spec import LLAMA
from ..llama.spec import split_sizes as llama_split_sizes
from ..spec import HfFormat, ModelFamily, Role, SplitSizes
from .config import CONFIGS, MixtralConfig, flops_per_token, param_shapes

__all__ = ["MIXTRAL"]

PARAM_ROLES = (
    (r"(^|\.)feed_forward\.gate\.weight$", Role.REPLICATED),
    (r"(^|\.)feed_forward\.w[13]$", Role.EXPERT_COLUMN),
    (r"(^|\.)feed_forward\.w2$", Role.EXPERT_ROW),
) + tuple((pattern, role) for pattern, role in LLAMA.param_roles
          if "feed_forward" not in pattern)


def _build(config: MixtralConfig):
    from .model import Mixtral

    return Mixtral(config)


def split_sizes(config: MixtralConfig) -> SplitSizes:
    llama = llama_split_sizes(config)
    return SplitSizes(width=llama.width, heads=llama.heads, hidden=llama.hidden,
                      experts={"n_experts": config.n_experts})


def _read_config(directory):
    from .hf import read_config

    return read_config(directory)


def _load(directory, dtype=None, device=None, max_seq_len=None):
    from .hf import from_pretrained

    return from_pretrained(directory, dtype=dtype, device=device, max_seq_len=max_seq_len)


def _read_weights(directory, params):
    from .hf import MixtralTensorNames
    from ..llama.hf import read_weights

    return read_weights(directory, params, names=MixtralTensorNames())


def _save(model, directory, **options):
    from .hf import save_pretrained

    return save_pretrained(model, directory, **options)


def _init_weights(model, seed: int = 0, device: Any = None):
    return LLAMA.init_weights(model, seed, device)


MIXTRAL = ModelFamily(
    name="mixtral",
    config_class=MixtralConfig,
    configs=CONFIGS,
    build=_build,
    init_weights=_init_weights,
    initial_values=LLAMA.initial_values,
    blocks=LLAMA.blocks,
    param_roles=PARAM_ROLES,
    split_sizes=split_sizes,
    param_shapes=param_shapes,
    flops_per_token=flops_per_token,
    qkv_projections=LLAMA.qkv_projections,
    localize_tensor_parallel=LLAMA.localize_tensor_parallel,
    hf=HfFormat(model_types=("mixtral",), read_config=_read_config, load=_load, save=_save,
                read_weights=_read_weights),
)
