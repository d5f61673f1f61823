"""The plain-PyTorch Llama on the tpu device: same logits and generations as on CPU."""

import copy

import torch

import tpu_train  # noqa: F401
from tpu_train.models import Llama, LlamaConfig, generate

from tests.tolerances import assert_rel_close, llama_functions, rtol_for


def _tiny_model():
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96,
                      ffn_hidden_dim=128, max_seq_len=64)
    with torch.device("meta"):
        model = Llama(cfg)
    model.init_weights(seed=3, device="cpu")
    return model.eval()


def test_logits_match_cpu():
    cpu_model = _tiny_model()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    # One float32 forward; longest reduction: the SwiGLU hidden size 128 (dim 64, 16 tokens),
    # 2 layers deep, each with its elementwise functions (on a TPU the softmax's exp alone is
    # 82 u from torch's).
    rtol = rtol_for(torch.float32, 128, depth=2, functions=llama_functions(2))
    assert_rel_close(tpu_model(tokens.to("tpu")), cpu_model(tokens), rtol, "logits")


def test_greedy_generation_with_kv_cache_matches_cpu_token_for_token():
    cpu_model = _tiny_model()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    prompt = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    expected = generate(cpu_model, prompt, max_new_tokens=8)
    got = generate(tpu_model, prompt.to("tpu"), max_new_tokens=8)
    assert got.device.type == "tpu"
    assert torch.equal(got.cpu(), expected)


def test_sampling_on_tpu_is_reproducible_with_a_generator():
    tpu_model = _tiny_model().to("tpu")
    prompt = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(2)).to("tpu")
    first = generate(tpu_model, prompt, 6, temperature=0.8, top_p=0.9,
                     generator=torch.Generator().manual_seed(5))
    second = generate(tpu_model, prompt, 6, temperature=0.8, top_p=0.9,
                      generator=torch.Generator().manual_seed(5))
    assert first.shape == (1, 10) and torch.equal(first.cpu(), second.cpu())
