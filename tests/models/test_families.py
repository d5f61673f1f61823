"""Qwen2.5 and Mistral as options of the one decoder: transformers-written checkpoints load with
transformers' logits, our exports reload in transformers with ours, Mistral's sliding window
holds past the window (whole sequences, a KV cache, a static cache), and configs that cannot
work are refused in one line."""

import dataclasses
import json

import pytest
import torch
import transformers

from tpu_train.models import (KVCache, Llama, LlamaConfig, config_from_hf, config_to_hf,
                              from_pretrained, generate, get_config, save_pretrained)
from tpu_train.models.generation import StaticCacheDecoding

from tests.tolerances import assert_rel_close, rtol_for

from .hf_reference import FAMILY_SHAPE, MISTRAL_WINDOW, hf_mistral, hf_qwen2, random_tokens

# Two float32 implementations of one forward, normwise over the logits; the longest reduction
# is the SwiGLU hidden size. At most the 1e-4 the families promise.
LOGITS_RTOL = min(rtol_for(torch.float32, FAMILY_SHAPE["intermediate_size"]), 1e-4)
SEQ = 40  # more than three Mistral windows
FAMILIES = {"qwen2": hf_qwen2, "mistral": hf_mistral}


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm())


def _assert_logits(ours, reference):
    assert ours.shape == reference.shape
    assert reference.abs().max() > 1.0  # not a vacuous comparison of near-zero logits
    assert_rel_close(ours, reference, LOGITS_RTOL, "logits")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (the transformers model, the directory it saved itself to)}."""
    saved = {}
    for family, make in FAMILIES.items():
        directory = tmp_path_factory.mktemp(family)
        reference = make()
        reference.save_pretrained(directory)
        saved[family] = reference, directory
    return saved


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_transformers_checkpoint_loads_with_its_logits(family, checkpoints):
    reference, directory = checkpoints[family]
    model = from_pretrained(directory).eval()
    config = model.config
    assert config.hf_model_type == family
    if family == "qwen2":
        assert config.qkv_bias and config.tie_embeddings and model.output is None
        assert (config.rope_theta, config.norm_eps, config.sliding_window) == (1e6, 1e-6, None)
        assert model.layers[0].attention.wq.bias.abs().max() > 0  # the checkpoint's biases
    else:
        assert not config.qkv_bias and config.sliding_window == MISTRAL_WINDOW
        assert model.layers[0].attention.wq.bias is None
    tokens = random_tokens(2, SEQ)
    with torch.no_grad():
        _assert_logits(model(tokens), reference(tokens).logits)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_export_reloads_in_transformers_with_our_logits(family, checkpoints, tmp_path):
    _, directory = checkpoints[family]
    model = from_pretrained(directory).eval()
    with torch.no_grad():  # moved off the checkpoint, so the export carries our weights
        for param in model.parameters():
            param.mul_(1.01)
    save_pretrained(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == family
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded).__name__ == {"qwen2": "Qwen2ForCausalLM",
                                       "mistral": "MistralForCausalLM"}[family]
    tokens = random_tokens(2, SEQ, seed=1)
    with torch.no_grad():
        _assert_logits(model(tokens), reloaded(tokens).logits)
    assert from_pretrained(tmp_path).config == model.config


def test_the_sliding_window_is_what_makes_mistral_match(checkpoints):
    """Past the window, transformers' eager attention (its own mask code) agrees, and the same
    weights without the window do not: the comparisons above cannot pass by accident."""
    reference, directory = checkpoints["mistral"]
    model = from_pretrained(directory).eval()
    eager = hf_mistral(attn_implementation="eager")
    tokens = random_tokens(1, SEQ, seed=2)
    unwindowed = Llama(dataclasses.replace(model.config, sliding_window=None)).eval()
    unwindowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        ours, expected = model(tokens), eager(tokens).logits
        _assert_logits(ours, expected)
        # Within the first window the two agree; past it they do not.
        without = unwindowed(tokens)
    assert_rel_close(without[:, :MISTRAL_WINDOW], expected[:, :MISTRAL_WINDOW], LOGITS_RTOL)
    assert _relative(without[:, MISTRAL_WINDOW:], expected[:, MISTRAL_WINDOW:]) > 1e-2


def test_decoding_through_a_kv_cache_keeps_the_window(checkpoints):
    """A prompt, a block after it (crossing the window) and then one token at a time: every
    step's logits are those of transformers' whole-sequence forward at those positions."""
    reference, directory = checkpoints["mistral"]
    model = from_pretrained(directory).eval()
    tokens = random_tokens(2, SEQ, seed=3)
    cache = KVCache.for_model(model, batch_size=2, max_seq_len=SEQ)
    # A ring of one window: no query sees further back.
    assert cache.keys[0].shape[2] == MISTRAL_WINDOW < SEQ
    with torch.no_grad():
        expected = reference(tokens).logits
        pieces = [model(tokens[:, :8], start_pos=0, cache=cache),
                  model(tokens[:, 8:23], start_pos=8, cache=cache)]
        pieces += [model(tokens[:, i:i + 1], start_pos=i, cache=cache) for i in range(23, SEQ)]
    _assert_logits(torch.cat(pieces, dim=1), expected)


def test_greedy_generation_past_the_window_is_transformers(checkpoints):
    reference, directory = checkpoints["mistral"]
    model = from_pretrained(directory).eval()
    prompt = random_tokens(2, 5, seed=6)
    ours = generate(model, prompt, max_new_tokens=SEQ - 5)
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=SEQ - 5, do_sample=False,
                                      attention_mask=torch.ones_like(prompt))
    assert torch.equal(ours, expected)


def test_a_static_cache_with_left_padding_keeps_the_window(checkpoints):
    """The compiled decoder's half (StaticCacheDecoding, run eagerly here): left-padded rows
    in a fixed-length cache attend within the window counted in slots."""
    reference, directory = checkpoints["mistral"]
    model = from_pretrained(directory).eval()
    decoding = StaticCacheDecoding()
    pad = torch.tensor([0, 5])
    length = SEQ
    tokens = random_tokens(2, SEQ - 5, seed=4)
    caches = [torch.zeros(shape, dtype=dtype)
              for shape, dtype in decoding.cache_shapes(model, 2, length)]
    # Row 1 is row 0's tokens shifted right by its padding; its padding slots hold token 0.
    rows = torch.stack([torch.cat([tokens[0], torch.zeros(5, dtype=torch.long)]),
                        torch.cat([torch.zeros(5, dtype=torch.long), tokens[0]])])
    with torch.no_grad():
        expected = reference(tokens[:1]).logits[0]
        _, caches = decoding.step(model, rows[:, :20], torch.tensor(0), pad, caches)
        last = []
        for slot in range(20, SEQ):
            logits, caches = decoding.step(model, rows[:, slot:slot + 1], torch.tensor(slot),
                                           pad, caches)
            last.append(logits)
    last = torch.stack(last, dim=1)  # [2, 20, vocab]: slots 20..39
    # Row 0 sits at positions 20..34 for its first 15 of these slots; row 1 at positions 15..34.
    assert_rel_close(last[0, :15], expected[20:35], LOGITS_RTOL)
    assert_rel_close(last[1], expected[15:35], LOGITS_RTOL)


def test_named_configs_are_their_families():
    qwen = get_config("qwen2_5_0_5b")
    assert (qwen.qkv_bias, qwen.tie_embeddings, qwen.rope_theta, qwen.hf_model_type) == (
        True, True, 1e6, "qwen2")
    mistral = get_config("mistral_7b")
    assert (mistral.sliding_window, mistral.hf_model_type, mistral.qkv_bias) == (
        4096, "mistral", False)
    for name in ("qwen2_5_0_5b", "qwen2_5_7b", "mistral_7b"):
        cfg = get_config(name)
        assert config_from_hf(config_to_hf(cfg)) == cfg
        hf_class = {"qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig}
        hf = hf_class[cfg.hf_model_type](**config_to_hf(cfg))
        assert hf.hidden_size == cfg.dim and hf.sliding_window == cfg.sliding_window


@pytest.mark.parametrize("change,message", [
    (dict(qkv_bias=True), "qkv_bias=True cannot be written as a Hugging Face 'llama' model"),
    (dict(sliding_window=64), "sliding_window=64 cannot be written as a Hugging Face 'llama'"),
    (dict(sliding_window=64, qkv_bias=True, hf_model_type="qwen2"), "hf_model_type='mistral'"),
    (dict(sliding_window=0, hf_model_type="mistral"), "sliding_window must be a positive int"),
    (dict(hf_model_type="gemma"), "hf_model_type must be one of llama, qwen2, mistral"),
])
def test_a_config_no_family_can_hold_is_refused(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(get_config("debug_tiny"), **change)


@pytest.mark.parametrize("family,change,message", [
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window=true"),
    ("qwen2", {"layer_types": ["sliding_attention", "full_attention"]}, "use_sliding_window"),
    ("mistral", {"sliding_window": -4}, "sliding_window must be a positive integer or null"),
    ("mistral", {"architectures": ["Qwen2ForCausalLM"]}, "unsupported architecture"),
])
def test_a_checkpoint_option_that_cannot_work_names_the_file(family, change, message,
                                                             checkpoints, tmp_path):
    _, directory = checkpoints[family]
    hf = json.loads((directory / "config.json").read_text())
    hf.update(change)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=message) as error:
        from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(error.value)
    assert "\n" not in str(error.value)


def test_initial_biases_are_zero_and_llama_initialization_is_unchanged():
    base = LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64,
                       ffn_hidden_dim=64, max_seq_len=16)
    llama = Llama(base).init_weights(seed=0)
    qwen = Llama(dataclasses.replace(base, qkv_bias=True, hf_model_type="qwen2")).init_weights(
        seed=0)
    state = qwen.state_dict()
    assert all(float(state[f"layers.0.attention.w{n}.bias"].abs().max()) == 0 for n in "qkv")
    assert all(torch.equal(value, state[name]) for name, value in llama.state_dict().items())
