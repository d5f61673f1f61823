"""Model families in plain PyTorch (Llama: ``tpu_train.models.llama``), with Hugging Face
interop and KV-cache generation.

Qwen2 / Qwen2.5 (q/k/v biases) and Mistral (a sliding attention window) are options of the Llama
decoder: ``LlamaConfig(qkv_bias=, sliding_window=, hf_model_type=)``, read from and written to
their Hugging Face ``config.json``.

Each family declares what the layers around its model need in one
:class:`ModelFamily` (``spec.py``); the registry (``registry.py``) finds it by name, config
name, model or Hugging Face ``model_type``, and takes families of the user's own::

    from tpu_train.models import family_named, family_of, register_family
    family = family_named("llama3_1_8b")          # LLAMA, the family owning that config
    family.param_shapes(family.config("llama3_1_8b"))
    register_family(MY_FAMILY)                     # then: tpu-train model.name=<its config>

A model is ordinary ``torch.nn`` code with no device, compile or parallel logic, so the same
module runs eagerly on the CPU or the ``tpu`` device and traces with ``make_fx`` for compiled
training steps. The Llama names below are importable from here as well as from
``tpu_train.models.llama`` (Mixtral's from ``tpu_train.models.mixtral``).

Configurations::

    from tpu_train.models import get_config, CONFIGS, num_params, flops_per_token
    cfg = get_config("llama3_1_8b", max_seq_len=8192)   # named config + field overrides
    sorted(CONFIGS)    # debug_tiny, llama2_7b, llama3_1_8b, ..., qwen2_5_0_5b, mistral_7b
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

Mixtral (``tpu_train.models.mixtral``, family ``MIXTRAL``: ``mixtral_tiny``,
``mixtral_8x7b``; ``MixtralConfig`` extends ``LlamaConfig`` with ``n_experts``, ``top_k``,
``router_aux_loss_coef``, ``moe_impl``): ``Mixtral(cfg)`` replaces each MLP with a
:class:`MoEFeedForward`; ``model(tokens, return_aux_loss=True)`` also returns the
load-balancing loss. ``tpu_train.models.mixtral.from_pretrained`` / ``save_pretrained`` (or
``checkpoint_family(dir).hf``) read and write ``MixtralForCausalLM`` directories.

Generation::

    out = generate(model, prompt_tokens, max_new_tokens=64)               # greedy
    out = generate(model, prompt_tokens, 64, temperature=0.8, top_p=0.95,
                   eos_token_id=[128001, 128009], generator=torch.Generator().manual_seed(0))

``out`` is ``[batch, prompt_len + new]`` on the model's device. Incremental decoding uses a
:class:`KVCache`, which can also be passed to the forward directly.
"""

import importlib

# Names load on first use (the trainer's pattern): the command line checks model.name against
# the registry's config names (registry.py, spec.py and llama/config.py: no torch) before it
# imports torch.
_SOURCES = {
    "CONFIGS": "llama.config", "LlamaConfig": "llama.config", "RopeScaling": "llama.config",
    "HF_MODEL_TYPES": "llama.config", "local_causal_mask": "llama.model",
    "flops_per_token": "llama.config", "get_config": "llama.config",
    "num_params": "llama.config", "param_shapes": "llama.config",
    "generate": "generation", "sample_next_token": "generation",
    "config_from_hf": "llama.hf", "config_to_hf": "llama.hf", "from_pretrained": "llama.hf",
    "hf_name": "llama.hf", "read_config": "llama.hf", "save_pretrained": "llama.hf",
    "KVCache": "llama.kv_cache",
    "Attention": "llama.model", "FeedForward": "llama.model", "Llama": "llama.model",
    "RMSNorm": "llama.model", "TransformerBlock": "llama.model", "init_weights": "llama.model",
    "apply_rotary": "llama.rope", "inverse_frequencies": "llama.rope",
    "rope_tables": "llama.rope",
    "LLAMA": "llama.spec",
    "Mixtral": "mixtral.model", "MixtralBlock": "mixtral.model",
    "MixtralConfig": "mixtral.config", "MOE_IMPLS": "mixtral.config", "MoEFeedForward": "mixtral.moe",
    "load_balancing_loss": "mixtral.moe", "MIXTRAL": "mixtral.spec",
    "HfFormat": "spec", "ModelFamily": "spec", "Role": "spec", "SplitSizes": "spec",
    "checkpoint_family": "registry", "config_names": "registry", "families": "registry",
    "family_for_hf": "registry", "family_named": "registry", "family_of": "registry",
    "named_config": "registry", "register_family": "registry",
    "unregister_family": "registry",
}

__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
