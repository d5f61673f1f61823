"""Named configs, config validation, parameter and FLOP accounting."""

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tpu_train.models import (Llama, LlamaConfig, config_names, family_named, flops_per_token,
                              get_config, named_config, num_params)

# Parameter counts of the published checkpoints (safetensors total_size / 2 bytes in bf16).
PUBLISHED_PARAMS = {
    "llama2_7b": 6_738_415_616,
    "llama3_2_1b": 1_235_814_400,
    "llama3_2_3b": 3_212_749_824,
    "llama3_1_8b": 8_030_261_248,
    "llama3_1_70b": 70_553_706_496,
    "qwen2_5_0_5b": 494_032_768,
    "qwen2_5_1_5b": 1_543_714_304,
    "qwen2_5_7b": 7_615_616_512,
    "mistral_7b": 7_241_732_096,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_named_configs_have_published_sizes(name):
    assert num_params(get_config(name)) == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("name", config_names())
def test_num_params_counts_the_built_model(name):
    family, config = family_named(name), named_config(name)
    with torch.device("meta"):
        model = family.build(config)
    assert sum(p.numel() for p in model.parameters()) == family.num_params(model.config)
    # The shape table, names, order and layout, without building the model.
    shapes = family.param_shapes(model.config)
    assert shapes == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert list(shapes) == [n for n, _ in model.named_parameters()]


def test_debug_tiny_is_the_documented_cpu_default():
    cfg = get_config("debug_tiny")
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden_dim,
            cfg.vocab_size, cfg.max_seq_len, cfg.rope_theta, cfg.tie_embeddings) == (
        256, 4, 4, 2, 768, 512, 256, 10000.0, False)


def test_llama3_configs_scale_rope():
    assert get_config("llama3_1_8b").rope_scaling.factor == 8.0
    assert get_config("llama3_2_1b").rope_scaling.factor == 32.0
    assert get_config("llama2_7b").rope_scaling is None


def test_unknown_config_lists_valid_names():
    with pytest.raises(KeyError, match="debug_tiny.*llama3_1_8b"):
        get_config("llama4_400b")


def test_get_config_overrides_fields_and_rejects_unknown_ones():
    assert get_config("llama3_1_8b", max_seq_len=8192).max_seq_len == 8192
    with pytest.raises(TypeError, match="seq_length"):
        get_config("debug_tiny", seq_length=8)


@pytest.mark.parametrize("change,message", [
    (dict(dim=250), "divisible by n_heads"),
    (dict(n_kv_heads=3), "multiple of n_kv_heads"),
    (dict(n_layers=0), "n_layers must be a positive int"),
    (dict(dim=12, n_heads=4, n_kv_heads=4), "must be even"),
])
def test_invalid_config_is_explained(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(get_config("debug_tiny"), **change)


def test_rope_scaling_accepts_a_plain_mapping():
    cfg = dataclasses.replace(get_config("debug_tiny"), rope_scaling={"factor": 8.0})
    assert cfg.rope_scaling.factor == 8.0 and cfg.rope_scaling.original_max_seq_len == 8192


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_matches_counted_training_flops(tied):
    # torch's FLOP counter over a real forward + backward is the outside reference; the math
    # SDPA backend makes the attention products visible to it as bmm calls.
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96,
                      ffn_hidden_dim=160, max_seq_len=32, tie_embeddings=tied)
    model = Llama(cfg).init_weights(seed=0)
    batch, seq = 2, 32
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens).sum().backward()
    assert counter.get_total_flops() == flops_per_token(cfg, seq) * batch * seq
