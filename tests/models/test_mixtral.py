"""Mixtral: the mixture of experts against transformers' ``MixtralForCausalLM`` (logits and
load-balancing loss, checkpoints both ways), the two expert forms against each other, the
grouped-matmul op's lowering against its CPU kernel, and bad checkpoints."""

import json

import pytest
import torch
import transformers

from tpu_train.models import MIXTRAL, Mixtral, checkpoint_family, family_of
from tpu_train.models.mixtral import flops_per_token, from_pretrained, param_shapes, \
    save_pretrained
from tpu_train.models.mixtral.moe import MoEFeedForward, load_balancing_loss

ATOL = 1e-4  # float32, tiny widths: the acceptance bound on logits and the aux loss


def hf_mixtral_dir(path, *, seed=0, tie=False, **overrides):
    """A tiny MixtralForCausalLM written by transformers' save_pretrained."""
    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                  router_aux_loss_coef=0.02, tie_word_embeddings=tie)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**fields)).eval()
    model.save_pretrained(path)
    return model


def _tokens(vocab=96, shape=(2, 24), seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral") / "hf"
    return path, hf_mixtral_dir(path)


def test_logits_and_aux_loss_match_transformers(checkpoint):
    path, reference = checkpoint
    assert checkpoint_family(path) is MIXTRAL  # config.json's model_type "mixtral"
    model = MIXTRAL.hf.load(path)
    assert isinstance(model, Mixtral) and model.config.n_experts == 4
    assert family_of(model) is MIXTRAL  # not Llama's, whose config MixtralConfig extends
    assert model.config.router_aux_loss_coef == 0.02
    tokens = _tokens()
    with torch.no_grad():
        expected = reference(tokens, output_router_logits=True, labels=tokens)
        logits, aux = model(tokens, return_aux_loss=True)
    torch.testing.assert_close(logits, expected.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(aux, expected.aux_loss, atol=ATOL, rtol=0)
    assert 1.0 < float(aux) < 4.0  # about top_k when balanced: a real figure, not zero


@pytest.mark.parametrize("impl", ["dense", "grouped"])
def test_both_expert_forms_match_transformers(checkpoint, impl):
    path, reference = checkpoint
    model = from_pretrained(path).use_moe_impl(impl)
    assert {layer.feed_forward.impl for layer in model.layers} == {impl}
    tokens = _tokens(seed=3)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, atol=ATOL, rtol=0)


def test_export_reloads_in_transformers(checkpoint, tmp_path):
    path, reference = checkpoint
    model = from_pretrained(path)
    save_pretrained(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "mixtral" and written["num_local_experts"] == 4
    reloaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = _tokens(seed=5)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, reference(tokens).logits,
                                   atol=0, rtol=0)


def test_grouped_gradients_equal_dense():
    torch.manual_seed(0)
    dense = MoEFeedForward(16, 24, n_experts=4, top_k=2, impl="dense")
    grouped = MoEFeedForward(16, 24, n_experts=4, top_k=2, impl="grouped")
    grouped.load_state_dict(dense.state_dict())
    x = torch.randn(3, 10, 16)
    grads = []
    for layer in (dense, grouped):
        out, logits = layer(x)
        (out.square().sum() + load_balancing_loss([logits], 4, 2)).backward()
        grads.append({n: p.grad for n, p in layer.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-5)


def test_grouped_matmul_lowering_matches_cpu_kernel():
    import jax.numpy as jnp
    import numpy as np

    from tpu_train.ops.grouped_matmul import GROUPED_MM, grouped_mm

    x, w = torch.randn(11, 8), torch.randn(3, 8, 5)
    sizes = torch.tensor([4, 0, 6], dtype=torch.int32)  # an empty group; one row past the last
    expected = GROUPED_MM(x, w, sizes)
    assert torch.equal(expected[10], torch.zeros(5))
    got = grouped_mm(jnp.asarray(x.numpy()), jnp.asarray(w.numpy()), jnp.asarray(sizes.numpy()))
    np.testing.assert_allclose(np.asarray(got), expected.numpy(), atol=1e-5, rtol=1e-5)


def test_grouped_matmul_op_refuses_pytorch_backward():
    # Without a PyTorch backward, torch's default would drop the experts' gradient silently.
    from tpu_train.ops.grouped_matmul import GROUPED_MM, differentiated_by_jax

    x, w = torch.randn(6, 4), torch.randn(2, 4, 3, requires_grad=True)
    sizes = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="grouped_mm has no PyTorch backward"):
        torch.func.grad(lambda w: GROUPED_MM(x, w, sizes).sum())(w.detach())
    with torch.no_grad():
        assert GROUPED_MM(x, w, sizes).shape == (6, 3)
    with differentiated_by_jax():  # where JAX differentiates the traced forward
        assert GROUPED_MM(x, w, sizes).shape == (6, 3)


def test_counts_all_experts_in_memory_and_active_ones_in_flops():
    cfg = MIXTRAL.config("mixtral_8x7b")
    num_params = MIXTRAL.num_params
    assert round(num_params(cfg) / 1e9, 1) == 46.7  # Mixtral-8x7B's published size
    shapes = param_shapes(cfg)
    assert shapes["layers.0.feed_forward.w1"] == (8, 14336, 4096)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert total == num_params(cfg)
    # FLOPs count the matmul weights one token uses: attention (q, o: 4096^2; k, v: 4096 x
    # 1024), 2 of the 8 experts (3 x 4096 x 14336 each), the router (4096 x 8); and the head.
    active = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 3 * 4096 * 14336 + 4096 * 8) \
        + 32000 * 4096
    assert flops_per_token(cfg, 1024) == 6 * active + 12 * 32 * 4096 * 1024


@pytest.mark.parametrize("change, message", [
    ({"sliding_window": 16}, "sliding_window=16"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
])
def test_unsupported_options_are_one_line_errors(tmp_path, change, message):
    hf_mixtral_dir(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as raised:
        from_pretrained(tmp_path)
    assert "\n" not in str(raised.value)


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_mixtral_dir(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.block_sparse_moe."
                                         "experts.3.w2.weight'"):
        from_pretrained(tmp_path)
