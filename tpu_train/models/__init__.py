"""Llama models in plain PyTorch, with Hugging Face interop and KV-cache generation.

The model is ordinary ``torch.nn`` code with no device, compile or parallel logic, so the same
module runs eagerly on the CPU or the ``tpu`` device and traces with ``make_fx`` for compiled
training steps.

Configurations::

    from tpu_train.models import get_config, CONFIGS, num_params, flops_per_token
    cfg = get_config("llama3_1_8b", max_seq_len=8192)   # named config + field overrides
    sorted(CONFIGS)    # debug_tiny, llama2_7b, llama3_1_70b, llama3_1_8b, llama3_2_1b, llama3_2_3b
    num_params(cfg)                # 8_030_261_248
    flops_per_token(cfg, 8192)     # 6 * matmul params + 12 * n_layers * dim * seq_len

Building and initializing (cheap on the meta device, then materialized once)::

    with torch.device("meta"):
        model = Llama(cfg)
    model.init_weights(seed=0, device="cpu")   # or init_weights(model, seed, device)

``model(tokens, start_pos=0, cache=None)`` maps ``[batch, seq]`` token ids to
``[batch, seq, vocab]`` logits in the parameters' dtype. Attention is plain causal
(``scaled_dot_product_attention(is_causal=True)``); grouped-query heads are expanded before it.
RoPE follows Hugging Face's rotate-half layout (with Llama-3.1 frequency scaling), so HF
weights load without permutation. Module names: ``tok_embeddings``,
``layers.N.attention.{wq,wk,wv,wo}``, ``layers.N.feed_forward.{w1,w2,w3}`` (gate, down, up),
``layers.N.{attention_norm,ffn_norm}``, ``norm``, ``output`` (absent when embeddings are tied).

Hugging Face checkpoints (safetensors, single file or sharded with an index)::

    model = from_pretrained("/ckpt/Llama-3.2-1B", dtype=torch.bfloat16, device="cpu",
                            max_seq_len=8192)   # optional: size RoPE for the length used
    save_pretrained(model, "/out/finetuned", max_shard_bytes=5 * 10**9, eos_token_id=128001)

``from_pretrained`` allocates the model once and copies tensors in one at a time; errors name
the file and tensor at fault. ``save_pretrained`` output loads with
``transformers.LlamaForCausalLM.from_pretrained`` and keeps the loaded checkpoint's bos/eos
ids unless others are given. ``config_from_hf`` / ``config_to_hf``
translate config dicts; ``read_config(dir)`` reads and checks a directory's config.json.

Mixtral (``mixtral_tiny``, ``mixtral_8x7b``; ``MixtralConfig`` adds ``n_experts``, ``top_k``,
``router_aux_loss_coef``, ``moe_impl``): ``Mixtral(cfg)`` replaces each MLP with a
:class:`MoEFeedForward`; ``model(tokens, return_aux_loss=True)`` also returns the
load-balancing loss. ``from_pretrained`` / ``save_pretrained`` read and write
``MixtralForCausalLM`` directories (config.json's ``model_type`` decides).

Generation::

    out = generate(model, prompt_tokens, max_new_tokens=64)               # greedy
    out = generate(model, prompt_tokens, 64, temperature=0.8, top_p=0.95,
                   eos_token_id=[128001, 128009], generator=torch.Generator().manual_seed(0))

``out`` is ``[batch, prompt_len + new]`` on the model's device. Incremental decoding uses a
:class:`KVCache`, which can also be passed to the forward directly.
"""

import importlib

# Names load on first use (the trainer's pattern): the command line checks model.name against
# CONFIGS (config.py, no torch) before it imports torch.
_SOURCES = {
    "CONFIGS": "config", "LlamaConfig": "config", "MixtralConfig": "config",
    "RopeScaling": "config",
    "flops_per_token": "config", "get_config": "config", "num_params": "config",
    "param_shapes": "config",
    "generate": "generation", "sample_next_token": "generation",
    "config_from_hf": "hf", "config_to_hf": "hf", "from_pretrained": "hf", "hf_name": "hf",
    "read_config": "hf", "save_pretrained": "hf",
    "KVCache": "kv_cache",
    "Attention": "llama", "FeedForward": "llama", "Llama": "llama", "RMSNorm": "llama",
    "TransformerBlock": "llama", "init_weights": "llama",
    "Mixtral": "mixtral", "MixtralBlock": "mixtral",
    "MoEFeedForward": "moe", "load_balancing_loss": "moe",
    "apply_rotary": "rope", "inverse_frequencies": "rope", "rope_tables": "rope",
}

__all__ = sorted(_SOURCES) + ["model_class"]


def model_class(config):
    """The module class that builds ``config``: :class:`Mixtral` for a ``MixtralConfig``,
    else :class:`Llama`."""
    from .config import MixtralConfig

    name = "Mixtral" if isinstance(config, MixtralConfig) else "Llama"
    return __getattr__(name)


def __getattr__(name: str):
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
