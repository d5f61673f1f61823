"""The model itself: initialization, KV-cache decoding, tracing, input validation."""

import pytest
import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call, functionalize, grad
from torch.nn.attention import SDPBackend, sdpa_kernel

from tpu_train.models import KVCache, Llama, LlamaConfig, RopeScaling, init_weights, num_params
from tpu_train.models.llama.rope import rope_tables

from tests.tolerances import SAFETY, assert_rel_close, rtol_for, unit_roundoff

SMALL = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96,
                    ffn_hidden_dim=160, rope_theta=500000.0,
                    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32), max_seq_len=64)
F32 = torch.float32
# Two float32 evaluations of SMALL's forward (or backward) in another order: the longest
# reduction is the SwiGLU hidden size 160 (dim 64, vocab 96, <= 20 tokens).
FORWARD_RTOL = rtol_for(F32, SMALL.ffn_hidden_dim)


def _meta_model(cfg=SMALL):
    with torch.device("meta"):
        return Llama(cfg)


def _tokens(batch, seq, seed=0, vocab=SMALL.vocab_size):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_meta_construction_allocates_nothing_until_init():
    model = _meta_model()
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    init_weights(model, seed=0)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert sum(p.numel() for p in model.parameters()) == num_params(SMALL)


def test_init_is_deterministic_per_seed_and_independent_of_construction():
    first = _meta_model().init_weights(seed=7)
    second = _meta_model().init_weights(seed=7)
    other_seed = _meta_model().init_weights(seed=8)
    built_on_cpu = Llama(SMALL).init_weights(seed=7)
    for name, value in first.state_dict().items():
        torch.testing.assert_close(second.state_dict()[name], value, rtol=0, atol=0)
        torch.testing.assert_close(built_on_cpu.state_dict()[name], value, rtol=0, atol=0)
    assert not torch.equal(first.layers[0].attention.wq.weight,
                           other_seed.layers[0].attention.wq.weight)


def test_init_draws_the_documented_distributions():
    model = _meta_model().init_weights(seed=0)
    assert torch.equal(model.layers[1].ffn_norm.weight, torch.ones(SMALL.dim))
    w1 = model.layers[0].feed_forward.w1.weight
    w2 = model.layers[0].feed_forward.w2.weight
    # Sampling error, not rounding: the standard error of a sample std over n normal draws
    # is std / sqrt(2n); allow five of them.
    for weight, std in ((w1, 0.02), (w2, 0.02 / (2 * SMALL.n_layers) ** 0.5)):
        assert abs(weight.std().item() - std) < 5 * std / (2 * weight.numel()) ** 0.5
    cos, sin = rope_tables(SMALL)
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)


def test_init_in_bf16_equals_fp32_init_rounded():
    fp32 = _meta_model().init_weights(seed=3)
    bf16 = _meta_model().to(torch.bfloat16).init_weights(seed=3)
    for (name, a), (_, b) in zip(fp32.named_parameters(), bf16.named_parameters()):
        assert b.dtype == torch.bfloat16, name
        assert torch.equal(a.to(torch.bfloat16), b), name


def test_tied_embeddings_share_one_matrix():
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=50,
                      ffn_hidden_dim=64, max_seq_len=16, tie_embeddings=True)
    model = Llama(cfg).init_weights(seed=0)
    assert model.output is None
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)
    tokens = _tokens(1, 5, vocab=50)
    hidden = model.norm(model.layers[0](model.tok_embeddings(tokens),
                                        model.rope_cos[:5], model.rope_sin[:5]))
    torch.testing.assert_close(model(tokens), hidden @ model.tok_embeddings.weight.T)


def test_kv_cache_decoding_equals_full_recomputation():
    model = Llama(SMALL).init_weights(seed=1)
    tokens = _tokens(2, 20, seed=4)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache.for_model(model, batch_size=2, max_seq_len=20)
        # A prefill, a multi-token block after a cached prefix, then single tokens.
        pieces = [model(tokens[:, :6], start_pos=0, cache=cache),
                  model(tokens[:, 6:11], start_pos=6, cache=cache)]
        pieces += [model(tokens[:, i:i + 1], start_pos=i, cache=cache) for i in range(11, 20)]
    # The same forward, its attention sums split differently (float32, longest reduction 160).
    assert_rel_close(torch.cat(pieces, dim=1), full, FORWARD_RTOL, "logits")


def test_kv_cache_rejects_overflow_and_wrong_batch():
    model = Llama(SMALL).init_weights(seed=0)
    cache = KVCache.for_model(model, batch_size=1, max_seq_len=8)
    with pytest.raises(ValueError, match="allocate a longer cache"):
        model(_tokens(1, 9), cache=cache)
    with pytest.raises(ValueError, match="batch size 1"):
        model(_tokens(2, 4), cache=cache)


def test_forward_rejects_bad_shapes_and_positions():
    model = Llama(SMALL).init_weights(seed=0)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len 64"):
        model(_tokens(1, 8), start_pos=60)


def test_start_pos_shifts_positions_without_a_cache():
    # Rotary attention depends on relative positions only: a shifted window gives the same
    # logits, which checks that start_pos reaches RoPE consistently for q and k.
    model = Llama(SMALL).init_weights(seed=2)
    tokens = _tokens(1, 12)
    with torch.no_grad():
        # Two forwards (longest reduction 160) whose RoPE angles pos * freq (pos <= 28,
        # freq <= 1) differ; each angle is rounded to float32, an error of ~pos ulp.
        rtol = FORWARD_RTOL + SAFETY * 28 * unit_roundoff(F32)
        assert_rel_close(model(tokens, start_pos=17), model(tokens), rtol, "logits")


def test_training_step_traces_with_make_fx_and_matches_eager():
    model = Llama(SMALL).init_weights(seed=5)
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())  # the RoPE tables travel as inputs, like params
    tokens = _tokens(2, 16, seed=6)
    targets = _tokens(2, 16, seed=7)

    def loss_fn(p, b, tokens, targets):
        logits = functional_call(model, {**p, **b}, (tokens,))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def step(p, b, tokens, targets):
        return grad(loss_fn)(p, b, tokens, targets)

    # The math SDPA backend is what a device without a fused kernel runs. (On the CPU the
    # default flash kernel's backward, traced next to the core-ATen decomposition of its
    # forward, yields wrong gradients in torch 2.13: a torch issue, not a model one.)
    with sdpa_kernel(SDPBackend.MATH):
        graph = make_fx(functionalize(step, remove="mutations"),
                        decomposition_table=core_aten_decompositions(),
                        tracing_mode="fake")(params, buffers, tokens, targets)
    called = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    # A host read of a tensor value would stall every compiled step.
    assert not called & {"aten._local_scalar_dense.default", "aten.item.default"}
    assert "aten.mm.default" in called
    traced = graph(params, buffers, tokens, targets)
    eager = step(params, buffers, tokens, targets)
    assert set(traced) == set(eager) == set(params)
    for name in params:
        # One backward in float32, decomposed vs fused kernels (longest reduction 160).
        assert_rel_close(traced[name], eager[name], FORWARD_RTOL, name)


def test_init_weights_refuses_to_move_a_materialized_model():
    model = Llama(SMALL)
    init_weights(model, seed=0, device="cpu")  # already there: fine
    with pytest.raises(ValueError, match=r"model\.to"):
        init_weights(model, seed=0, device="meta")


def test_initial_values_drawn_in_pieces_are_those_drawn_whole():
    """An initialization drawn a piece of rows at a time (as an 8B's embedding table is) gives
    the values of drawing each weight whole: the pieces are multiples of the 16 values torch's
    CPU ``normal_`` fills at a time, so the generator's stream is consumed the same way."""
    import math

    from tpu_train.models import get_config
    from tpu_train.models.llama.model import initial_values

    config = get_config("debug_tiny")
    with torch.device("meta"):
        shapes = [(n, tuple(p.shape)) for n, p in Llama(config).named_parameters()]

    def values(piece_elements):
        whole = {}
        for name, rows, value in initial_values(config, shapes, 3, piece_elements):
            whole.setdefault(name, []).append(value)
        return {name: torch.cat(parts) for name, parts in whole.items()}

    pieces, whole = values(1000), values(2**30)
    assert any(name for name, shape in shapes if math.prod(shape) > 1000)
    assert pieces.keys() == whole.keys()
    assert all(torch.equal(pieces[name], whole[name]) for name in whole)
