"""A transformers Llama of a size no named model option has, with its own tokenizer (trained
with `tokenizers`, saved by `PreTrainedTokenizerFast`) and chat template, saved in one directory
as a user would have it: what the real-checkpoint tests fine-tune and the bad-input suite
damages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Special tokens no built-in heuristic knows: the run can only find them through the
# checkpoint's tokenizer_config.json / special_tokens_map.json.
BOS, EOS, PAD = "<|start|>", "<|stop|>", "<|fill|>"
CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")
# Not one of the named model options (debug_tiny is 256 wide, 4 layers, 4 heads).
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 96, 3, 6, 2, 200

LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Add the two numbers and write the sum.",
    "Reverse the letters of the word and answer with it.",
    "A checkpoint holds the weights; a tokenizer turns text into ids.",
    "Rivers run to the sea, and the sea is never full.",
    "Count the vowels in the sentence and reply with a number.",
]


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[BOS, EOS, PAD, *CHAT_SPECIALS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(LINES * 4, trainer=trainer)
    return tok




# The options of the other families at this size: Qwen2's biases (random here, so that they
# matter), RoPE base and tied embeddings; Mistral's sliding window, shorter than a 32-token row.
FAMILY_OPTIONS = {
    "llama": dict(rope_theta=20000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2": dict(rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "mistral": dict(rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    sliding_window=8, head_dim=HIDDEN // HEADS),
}


def save_custom_llama(directory: Path, family: str = "llama") -> Path:
    """Write the tokenizer and a seeded random LlamaForCausalLM (or Qwen2ForCausalLM,
    MistralForCausalLM) into ``directory``."""
    import transformers

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(),
                                                bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(directory)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    config = config_class(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=len(fast),
        max_position_embeddings=64, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, **FAMILY_OPTIONS[family])
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # transformers starts them at zero
                param.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def custom_llama(tmp_path_factory) -> Path:
    """The saved checkpoint, built once per test session; tests that damage it work on a copy."""
    pytest.importorskip("transformers")
    return save_custom_llama(tmp_path_factory.mktemp("ckpt") / "custom-llama")
