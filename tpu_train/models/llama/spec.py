"""The Llama family (Llama 2 / 3 / 3.1 / 3.2): what the trainer, the parallel plans and the
planner need of it (:class:`tpu_train.models.ModelFamily`).

Parameter roles, Megatron-style column -> row pairs in every attention and MLP block:

==============================  ============  ================================================
parameter                       role          why
==============================  ============  ================================================
``tok_embeddings.weight``       embedding     vocabulary-parallel embedding rows
``attention.w{q,k,v}.weight``   column        heads split on ``tensor``
``attention.w{q,k,v}.bias``     column_bias   as its weight's rows (Qwen2)
``attention.wo.weight``         row           its input (heads) split; partial sums reduced
``feed_forward.w{1,3}.weight``  column        hidden units split
``feed_forward.w2.weight``      row
``*norm.weight``                replicated    small; FSDP still shards it
``output.weight``               output        vocabulary-parallel logits
==============================  ============  ================================================

Module-level torch-free: the model, the Hugging Face code and their torch import load when a
model is built, loaded or saved.
"""

from __future__ import annotations

from typing import Any

from ..spec import HfFormat, ModelFamily, Role, SplitSizes
from .config import CONFIGS, HF_MODEL_TYPES, LlamaConfig, flops_per_token, param_shapes

__all__ = ["LLAMA"]

PARAM_ROLES = (
    (r"(^|\.)tok_embeddings\.weight$", Role.EMBEDDING),
    (r"(^|\.)attention\.w[qkv]\.weight$", Role.COLUMN),
    (r"(^|\.)attention\.w[qkv]\.bias$", Role.COLUMN_BIAS),  # Qwen2
    (r"(^|\.)attention\.wo\.weight$", Role.ROW),
    (r"(^|\.)feed_forward\.w[13]\.weight$", Role.COLUMN),
    (r"(^|\.)feed_forward\.w2\.weight$", Role.ROW),
    (r"(^|\.)(attention_norm|ffn_norm|norm)\.weight$", Role.REPLICATED),
    (r"(^|\.)output\.weight$", Role.OUTPUT),
)


def _build(config: LlamaConfig):
    from .model import Llama

    return Llama(config)


def _init_weights(model, seed: int = 0, device: Any = None):
    from .model import init_weights

    return init_weights(model, seed, device)


def _initial_values(config: LlamaConfig, shapes, seed: int = 0):
    from .model import initial_values

    return initial_values(config, shapes, seed)


def _blocks(model):
    return model.layers


def split_sizes(config: LlamaConfig) -> SplitSizes:
    return SplitSizes(width={"dim": config.dim},
                      heads={"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads},
                      hidden={"ffn_hidden_dim": config.ffn_hidden_dim,
                              "vocab_size": config.vocab_size})


def localize_heads(model, tensor: int) -> None:
    """After tensor parallelism split q/k/v by heads, each block's attention reshapes with its
    local head counts (read from the config at construction, not ``view(-1)``); the
    grouped-query ratio is unchanged. A split model is for training: its KV cache (sized
    from the config) does not match the local counts."""
    for block in model.layers:
        block.attention.n_heads //= tensor
        block.attention.n_kv_heads //= tensor


def _read_config(directory):
    from .hf import read_config

    return read_config(directory)


def _load(directory, dtype=None, device=None, max_seq_len=None):
    from .hf import from_pretrained

    return from_pretrained(directory, dtype=dtype, device=device, max_seq_len=max_seq_len)


def _read_weights(directory, params):
    from .hf import read_weights

    return read_weights(directory, params)


def _save(model, directory, **options):
    from .hf import save_pretrained

    return save_pretrained(model, directory, **options)


LLAMA = ModelFamily(
    name="llama",
    config_class=LlamaConfig,
    configs=CONFIGS,
    build=_build,
    init_weights=_init_weights,
    initial_values=_initial_values,
    blocks=_blocks,
    param_roles=PARAM_ROLES,
    split_sizes=split_sizes,
    param_shapes=param_shapes,
    flops_per_token=flops_per_token,
    qkv_projections=("attention.wq", "attention.wk", "attention.wv"),
    localize_tensor_parallel=localize_heads,
    hf=HfFormat(model_types=tuple(HF_MODEL_TYPES), read_config=_read_config, load=_load,
                save=_save, read_weights=_read_weights),
)
