"""transformers' causal LMs train through ``compile_train_step`` unchanged, like CPU PyTorch.

Llama, Qwen2, Gemma, Phi3 and GPT-2 from ``transformers`` (tiny random configs, default
``sdpa`` attention, ``model.train()``, the model's own ``labels=`` loss), with and without a
padded ``attention_mask``: 5 AdamW steps compiled on the tpu device against the same model
and ``torch.optim.AdamW`` eagerly on the CPU (the oracle). Losses must agree within the float32
rounding of the computation (tests/tolerances.py: at most 1.9e-5 relative here, inside the
1e-4 the feature promises), parameters within the AdamW bound.

These models are code we did not write: they make ``torch.tensor([], device=...)`` in every
forward (the KV cache), tie their output embedding to the input one (Gemma, GPT-2) and skip
host-side mask checks only when ``torch.compiler.is_compiling()`` (or another "am I being
traced?" test) says so — the trace must answer yes, or the mask check reads a fake value.
"""

import copy

import pytest
import torch
import transformers
from transformers.utils.import_utils import is_torchdynamo_compiling, is_tracing

from tests.tolerances import CROSS_ENTROPY_FUNCTIONS, loss_rtol, param_atol
from tpu_train.compile import compile_train_step
from tpu_train.compile.tracing import compile_session

from .helpers import (DEVICE, OPTIMIZERS, assert_losses_close, optimizer_lr,
                      run_reference, to_device)

STEPS, BATCH, SEQ, VOCAB = 5, 2, 16, 256
_LAYERS = 2
F32 = torch.float32
# Longest reduction in a step: the cross-entropy's log-sum-exp and the LM head's input
# gradient over the vocabulary (the others: hidden 64, MLP 128, 2 x 16 tokens).
REDUCTION = VOCAB
# Chained reductions behind a parameter's gradient (for the parameter bound; the losses move
# only by lr x that error and use the forward's): a token's path through a decoder layer
# chains six (q/k/v projection, q . k scores, the weighted sum of v, the output projection, the
# MLP's two matmuls), then the LM head and the cross-entropy: 6 x 2 layers + 2 forward, and
# as many back.
GRAD_DEPTH = 2 * (6 * 2 + 2)
# The elementwise functions along a forward, for every architecture here (a superset: each
# layer's two norms' rsqrt, its softmax's exp, SiLU's sigmoid or a tanh GELU; the final norm;
# the cross-entropy), each adding its measured error (tests/tolerances rtol_for).
FUNCTIONS = (("rsqrt", "rsqrt", "exp", "sigmoid", "tanh") * _LAYERS + ("rsqrt",)
             + CROSS_ENTROPY_FUNCTIONS)
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=_LAYERS,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _gpt2_config():
    # GPT-2 defaults to 10 % dropout: CPU and tpu draw different masks from their own
    # generators, so a loss comparison needs it off (the other configs default to none).
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=_LAYERS, n_head=4,
                                   n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0)


ARCHITECTURES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DECODER)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_DECODER)),
    "gemma": lambda: transformers.GemmaForCausalLM(
        transformers.GemmaConfig(head_dim=16, **_DECODER)),
    # Phi3's default pad_token_id (32000) is outside a 256-token vocabulary.
    "phi3": lambda: transformers.Phi3ForCausalLM(
        transformers.Phi3Config(pad_token_id=0, **_DECODER)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(_gpt2_config()),
}
TIED = {"gemma", "gpt2"}  # tie_word_embeddings by default


def make_model(arch: str, use_cache: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    model = ARCHITECTURES[arch]()
    assert model.config._attn_implementation == "sdpa"
    model.config.use_cache = use_cache
    return model.train()


def batches(masked: bool) -> list[dict]:
    """STEPS batches of token ids with labels = ids (the model shifts them); ``masked``: the
    second row is left-padded (mask 0, label -100) over a different length each step."""
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if masked:
            mask = torch.ones(BATCH, SEQ, dtype=torch.long)
            mask[1, :3 + step] = 0
            batch["labels"][mask == 0] = -100
            batch["attention_mask"] = mask
        out.append(batch)
    return out


def hf_loss(model, batch):
    return model(**batch).loss


def tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def run_compiled(model, make_opt, batches_):
    """The loop of ``run_reference`` through compile_train_step on the tpu device."""
    model = copy.deepcopy(model).to(DEVICE)
    # What torch_xla users do after a move: keeps the tie whether or not ``.to`` does.
    model.tie_weights()
    opt = make_opt(model.parameters())
    step = compile_train_step(model, opt, hf_loss)
    losses = [float(step(to_device(b))["loss"].cpu()) for b in batches_]
    return losses, model, step


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_matches_cpu_eager(arch, masked):
    """The masked runs also turn the KV cache off (``use_cache=False``, as fine-tuning scripts
    do): the decoder layers then take only tensors and plain values, so each is a call of one
    traced body (tpu_train.compile.shared_layers); with the cache object they are traced
    inline."""
    model = make_model(arch, use_cache=not masked)
    make_opt, data = OPTIMIZERS["adamw"], batches(masked)
    assert tied(model) == (arch in TIED)
    cpu_losses, cpu_model, _, _ = run_reference(model, make_opt, hf_loss, data, device="cpu")
    losses, compiled_model, step = run_compiled(model, make_opt, data)
    assert tied(compiled_model) == (arch in TIED)
    assert_losses_close(losses, cpu_losses, loss_rtol(F32, STEPS, REDUCTION, functions=FUNCTIONS))
    assert_params_match(compiled_model, cpu_model)
    (record,) = step.compilations
    assert record.shared_layer_calls == (_DECODER["num_hidden_layers"] if masked else 0)


def test_a_property_read_under_no_grad_keeps_the_shared_layers(monkeypatch):
    """transformers 5.17's rotary embedding (as on the TPU host's own package index) runs
    under ``@torch.no_grad()`` and reads ``x.device`` and ``x.dtype`` of the hidden states,
    which depend on the parameters. A property read that gives no tensor cuts no gradient:
    the step stays on JAX's autodiff with its decoder layers shared (the installed
    transformers' forward, run under no_grad, does the same reads). A property that gives a
    tensor (``x.mT``) still sends the step to PyTorch's backward."""
    from tpu_train.compile.loss_graph import TorchAutogradNeeded, _AutogradProbe

    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding
    forward = rotary.forward

    def under_no_grad(self, x, position_ids):
        with torch.no_grad():
            return forward(self, x, position_ids)

    monkeypatch.setattr(rotary, "forward", under_no_grad)
    model = make_model("llama", use_cache=False)
    _, _, step = run_compiled(model, OPTIMIZERS["adamw"], batches(True)[:1])
    (record,) = step.compilations
    assert (record.autodiff_fallback, record.shared_layer_calls) == \
        ("", _DECODER["num_hidden_layers"])

    x = torch.randn(2, 3, requires_grad=True)
    with _AutogradProbe(), torch.no_grad():
        assert (x.device, x.dtype, x.shape) == (torch.device("cpu"), F32, (2, 3))
        with pytest.raises(TorchAutogradNeeded, match="under torch.no_grad()"):
            x.mT


def _split_key_bias(name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rest, the attention key bias) of a parameter, flat.

    The key bias adds q . b_k to every score of a query's row, which softmax ignores: its exact
    gradient is 0, so both sides' gradients are their own rounding noise, which Adam scales up
    to updates as large as lr (tests/tolerances.py's noise-dominated case). Qwen2 has a
    ``k_proj.bias``; GPT-2 fuses q, k, v into ``c_attn`` (its bias: q, k, v thirds)."""
    t = t.detach().cpu().double().reshape(-1)
    if name.endswith("k_proj.bias"):
        return t[:0], t
    if name.endswith("c_attn.bias"):
        q, k, v = t.chunk(3)
        return torch.cat([q, v]), k
    return t, t[:0]


def assert_params_match(model, reference):
    """Every parameter within the AdamW bound (tests/tolerances.param_atol), apart from the
    key biases, whose noise-driven updates are only bounded by 2 x lr per step."""
    lr = optimizer_lr(OPTIMIZERS["adamw"])
    cap = 2 * STEPS * lr
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        (p_rest, p_key), (q_rest, q_key) = _split_key_bias(name, p), _split_key_bias(name, q)
        if q_rest.numel():
            limit = param_atol(F32, lr, STEPS, reduction=REDUCTION, numel=q_rest.numel(),
                               depth=GRAD_DEPTH, functions=2 * FUNCTIONS)  # forward and back
            err = float((p_rest - q_rest).norm()) / q_rest.numel() ** 0.5
            assert err <= limit, f"{name}: RMS difference {err:.2e} > {limit:.2e}"
        if q_key.numel():
            err = float((p_key - q_key).abs().max())
            assert err <= cap, f"{name} (key bias): difference {err:.2e} > {cap:.2e}"


def _tracing_answers(x: torch.Tensor) -> dict:
    """What model code asking "am I being traced?" gets: torch's public check, transformers'
    wrappers (the ones its mask utilities use) and ``is_exporting``, which must stay False (we
    are not exporting; models pick export-only code paths on it)."""
    return {"torch.compiler.is_compiling": torch.compiler.is_compiling(),
            "transformers is_torchdynamo_compiling": is_torchdynamo_compiling(),
            "transformers is_tracing(tensor)": is_tracing(x),
            "not torch.compiler.is_exporting": not torch.compiler.is_exporting()}


def test_trace_says_it_is_compiling():
    """True inside the compiled step's trace (where the loss function runs), False outside:
    before, after, and in the eager forward the same step object never re-traces."""
    seen = []

    def loss_fn(model, batch):
        seen.append(_tracing_answers(batch["x"]))
        return model(batch["x"]).square().mean()

    x = torch.randn(4, 3)
    outside = _tracing_answers(x)
    assert outside == dict.fromkeys(outside, False) | {"not torch.compiler.is_exporting": True}
    model = torch.nn.Linear(3, 2).to(DEVICE)
    step = compile_train_step(model, torch.optim.AdamW(model.parameters()), loss_fn)
    step({"x": x.to(DEVICE)})
    step({"x": x.to(DEVICE)})
    assert len(seen) == 1, "the loss function runs once, while tracing"
    assert seen[0] == dict.fromkeys(seen[0], True)
    assert _tracing_answers(x) == outside


def test_compile_session_nests_and_restores():
    assert not torch.compiler.is_compiling()
    with compile_session():
        with compile_session():
            assert torch.compiler.is_compiling()
        assert torch.compiler.is_compiling()
    assert not torch.compiler.is_compiling()
    with pytest.raises(ValueError), compile_session():
        raise ValueError
    assert not torch.compiler.is_compiling()


def test_compile_session_without_torch_213_context(monkeypatch):
    """torch 2.11 / 2.12 have no ``_compile_session_context``: the module flag that export
    toggles must do the same there (the installed torch runs that branch here)."""
    monkeypatch.delattr(torch.compiler, "_compile_session_context")
    with compile_session():
        assert torch.compiler.is_compiling()
    assert not torch.compiler.is_compiling()


def test_tensor_literal_on_the_device_inside_the_step():
    """``torch.tensor(data, device=x.device)`` in the loss (transformers' KV cache makes an
    empty one per layer) becomes a graph constant moved to the device, not a real device
    tensor captured by the trace."""

    def loss_fn(model, batch):
        x = batch["x"]
        scale = torch.tensor([0.5, 2.0, -1.0], dtype=x.dtype, device=x.device)
        empty = torch.tensor([], dtype=x.dtype, device=x.device).reshape(0, 3)
        return model(torch.cat([empty, x * scale])).square().mean()

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    data = [{"x": torch.randn(4, 3)} for _ in range(3)]
    make_opt = OPTIMIZERS["adamw"]
    cpu_losses, _, _, _ = run_reference(model, make_opt, loss_fn, data, device="cpu")
    device_model = copy.deepcopy(model).to(DEVICE)
    step = compile_train_step(device_model, make_opt(device_model.parameters()), loss_fn)
    losses = [float(step(to_device(b))["loss"].cpu()) for b in data]
    assert_losses_close(losses, cpu_losses, loss_rtol(F32, len(data), 4 * 3))
