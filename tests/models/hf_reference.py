"""Tiny random `transformers` Llama, Qwen2 and Mistral models used as the reference
implementation."""

from __future__ import annotations

import math

import torch
import transformers

VOCAB = 96
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small enough that, with head_dim 16 and theta 5e5, some frequencies are kept, one falls
    # in the interpolated band and the rest are scaled.
    "original_max_position_embeddings": 64,
}

# Keyword arguments for transformers.LlamaConfig, one per Llama generation.
HF_STYLES = {
    "llama2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, intermediate_size=176, vocab_size=VOCAB,
                   max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                   tie_word_embeddings=False),
    "llama3_1": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=2, intermediate_size=224, vocab_size=VOCAB,
                     max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0,
                     rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False),
    "llama3_2": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=2, intermediate_size=256, vocab_size=VOCAB,
                     max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0,
                     rope_scaling={**LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True),
}


def hf_llama(style: str, seed: int = 0) -> transformers.LlamaForCausalLM:
    """A float32 reference model whose every weight (norm scales included) is random.

    HF's default init gives near-zero logits and unit norm scales, under which swapped or
    misnamed tensors could go unnoticed; weights here keep activations O(1) and make every
    tensor distinguishable.
    """
    kwargs = dict(HF_STYLES[style])
    kwargs.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config = transformers.LlamaConfig(**kwargs)
    torch.manual_seed(seed)
    return randomized(transformers.LlamaForCausalLM(config), seed)


# Qwen2.5's and Mistral's options at a tiny size: Qwen2's q/k/v biases, RoPE base 1e6 and
# tied embeddings; Mistral's sliding window, shorter than the sequences the tests run.
FAMILY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=160, vocab_size=VOCAB,
                    max_position_embeddings=128)
MISTRAL_WINDOW = 12


def hf_qwen2(seed: int = 0) -> transformers.Qwen2ForCausalLM:
    """A random float32 Qwen2ForCausalLM (biases random too, not HF's zeros)."""
    config = transformers.Qwen2Config(**FAMILY_SHAPE, rms_norm_eps=1e-6, rope_theta=1e6,
                                      tie_word_embeddings=True, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return randomized(transformers.Qwen2ForCausalLM(config), seed)


def hf_mistral(seed: int = 0, sliding_window: int | None = MISTRAL_WINDOW,
               attn_implementation: str = "sdpa") -> transformers.MistralForCausalLM:
    """A random float32 MistralForCausalLM whose attention sees the last ``sliding_window``
    positions."""
    config = transformers.MistralConfig(**FAMILY_SHAPE, head_dim=16, rms_norm_eps=1e-5,
                                        rope_theta=10000.0, sliding_window=sliding_window,
                                        tie_word_embeddings=False, bos_token_id=None,
                                        eos_token_id=None, pad_token_id=None,
                                        attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    return randomized(transformers.MistralForCausalLM(config), seed)


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` in eval mode with every weight random (see :func:`hf_llama`)."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator)
                            / math.sqrt(param.shape[-1]))
    return model


def random_tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
