"""Hugging Face interop: logits parity with `transformers`, both load directions, errors."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tpu_train.models import (
    Llama,
    LlamaConfig,
    RopeScaling,
    config_from_hf,
    config_to_hf,
    from_pretrained,
    save_pretrained,
)

from tests.tolerances import assert_rel_close, rtol_for

from .hf_reference import HF_STYLES, hf_llama, random_tokens

# Two float32 implementations of one forward (ours, transformers'), normwise over the logits.
# Longest reduction: the largest SwiGLU hidden size of the reference styles (256; hidden <= 128,
# <= 48 tokens, vocab 96).
LOGITS_RTOL = rtol_for(torch.float32, max(s["intermediate_size"] for s in HF_STYLES.values()))


def _hf_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(tokens).logits


def _our_logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


def _assert_close_logits(ours, reference):
    assert ours.shape == reference.shape
    # Guard against a vacuous comparison of near-zero logits.
    assert reference.abs().max() > 1.0
    assert_rel_close(ours, reference, LOGITS_RTOL, "logits")


@pytest.mark.parametrize("style", ["llama2", "llama3_1", "llama3_2"])
def test_from_pretrained_matches_transformers(tmp_path, style):
    hf_model = hf_llama(style)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    model = from_pretrained(tmp_path)
    tokens = random_tokens(2, 48)
    _assert_close_logits(_our_logits(model, tokens), _hf_logits(hf_model, tokens))
    if style == "llama3_2":
        assert model.config.tie_embeddings and model.output is None
    if style == "llama3_1":
        assert model.config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
        assert model.config.n_kv_heads == 2


def test_from_pretrained_reads_sharded_checkpoint(tmp_path):
    hf_model = hf_llama("llama3_1")
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    model = from_pretrained(tmp_path)
    tokens = random_tokens(2, 40, seed=1)
    _assert_close_logits(_our_logits(model, tokens), _hf_logits(hf_model, tokens))


def test_from_pretrained_honours_dtype_and_device(tmp_path):
    hf_llama("llama2").save_pretrained(tmp_path, safe_serialization=True)
    model = from_pretrained(tmp_path, dtype=torch.bfloat16, device="cpu", max_seq_len=32)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.max_seq_len == 32 and model.rope_cos.shape[0] == 32
    assert model(random_tokens(1, 8)).dtype == torch.bfloat16


@pytest.mark.parametrize("style,max_shard_bytes", [
    ("llama3_1", 5 * 10**9),
    ("llama3_2", 60_000),
])
def test_save_pretrained_loads_in_transformers(tmp_path, style, max_shard_bytes):
    source = hf_llama(style, seed=3)
    source.save_pretrained(tmp_path / "source", safe_serialization=True)
    model = from_pretrained(tmp_path / "source")
    save_pretrained(model, tmp_path / "ours", max_shard_bytes=max_shard_bytes)
    sharded = (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    assert sharded == (max_shard_bytes < 10**6)
    assert (tmp_path / "ours" / "generation_config.json").is_file()

    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    tokens = random_tokens(2, 48, seed=2)
    _assert_close_logits(_our_logits(model, tokens), _hf_logits(reloaded, tokens))
    _assert_close_logits(_our_logits(from_pretrained(tmp_path / "ours"), tokens),
                         _hf_logits(source, tokens))


def test_save_pretrained_keeps_the_source_special_tokens(tmp_path):
    source = hf_llama("llama2")
    source.config.bos_token_id, source.config.eos_token_id = 1, [2, 5]
    source.save_pretrained(tmp_path / "source", safe_serialization=True)
    save_pretrained(from_pretrained(tmp_path / "source"), tmp_path / "ours")
    for file in ("config.json", "generation_config.json"):
        written = json.loads((tmp_path / "ours" / file).read_text())
        assert (written["bos_token_id"], written["eos_token_id"]) == (1, [2, 5]), file


def test_save_pretrained_replaces_an_earlier_sharded_save(tmp_path):
    model = Llama(LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64,
                              ffn_hidden_dim=64, max_seq_len=16)).init_weights(seed=0)
    save_pretrained(model, tmp_path, max_shard_bytes=4_000)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_config_round_trip_through_hf_dict():
    cfg = LlamaConfig(dim=128, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=1000,
                      ffn_hidden_dim=320, norm_eps=1e-6, rope_theta=500000.0,
                      rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), max_seq_len=4096,
                      tie_embeddings=True)
    assert config_from_hf(config_to_hf(cfg)) == cfg
    hf_config = transformers.LlamaConfig(**config_to_hf(cfg))
    assert hf_config.rope_parameters["rope_type"] == "llama3"
    assert hf_config.rope_parameters["factor"] == 32.0
    assert hf_config.num_key_value_heads == 2 and hf_config.tie_word_embeddings


def test_config_from_hf_reads_rope_parameters_format():
    hf = hf_llama("llama3_1").config.to_dict()  # transformers 5 writes rope_parameters
    hf.pop("rope_scaling", None)
    hf.pop("rope_theta", None)
    cfg = config_from_hf(hf)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.original_max_seq_len == 64


# ------------------------------------------------------------------------------------------
# Errors name the file and tensor at fault.


def _saved(tmp_path, style="llama2"):
    hf_llama(style).save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def test_missing_config_names_the_file(tmp_path):
    _saved(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        from_pretrained(tmp_path)


def test_missing_weights_names_the_directory(tmp_path):
    _saved(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        from_pretrained(tmp_path)


def test_missing_tensor_names_tensor_and_file(tmp_path):
    weights = _saved(tmp_path) / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        from_pretrained(tmp_path)
    assert "model.layers.1.mlp.up_proj.weight" in str(error.value)
    assert str(weights) in str(error.value)


def test_shard_missing_from_index_names_the_shard(tmp_path):
    hf_llama("llama2").save_pretrained(tmp_path, safe_serialization=True, max_shard_size="50KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        from_pretrained(tmp_path)


def test_shape_mismatch_names_tensor_shapes_and_file(tmp_path):
    weights = _saved(tmp_path) / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 7)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        from_pretrained(tmp_path)
    message = str(error.value)
    for expected in ("model.layers.0.self_attn.k_proj.weight", "[5, 7]", "[64, 64]",
                     str(weights)):
        assert expected in message


def test_unexpected_tensor_names_tensor_and_file(tmp_path):
    weights = _saved(tmp_path) / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"q_proj\.bias") as error:
        from_pretrained(tmp_path)
    assert str(weights) in str(error.value)


@pytest.mark.parametrize("change,expected", [
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "gemma"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, "yarn"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_unsupported_config_names_file_and_field(tmp_path, change, expected):
    _saved(tmp_path)
    config_path = tmp_path / "config.json"
    hf = json.loads(config_path.read_text())
    hf.update(change)
    config_path.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=expected) as error:
        from_pretrained(tmp_path)
    assert str(config_path) in str(error.value)
