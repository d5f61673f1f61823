"""The loss over chunks of tokens (tpu_train.compile.cross_entropy) against ``F.cross_entropy``
of the full logits: values and gradients on the CPU, on the tpu device op by op, in compiled
steps (JAX's and PyTorch's differentiation), with ignored labels, a padded last chunk and tied
embeddings; and the compiled program holds no float32 logits larger than one chunk."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from tests.tolerances import CROSS_ENTROPY_FUNCTIONS, loss_rtol, rtol_for, update_rtol
from tpu_train.compile import lower_train_step
from tpu_train.compile.cross_entropy import linear_cross_entropy_sum, set_chunk_tokens
from tpu_train.ops.linear_cross_entropy import chunk_layout, chunk_rows_for
from tpu_train.trainer.step import IGNORE_INDEX, causal_lm_loss_sum, output_weight

from .helpers import (DEVICE, OPTIMIZERS, _llama, assert_losses_close, assert_params_close,
                      lm_batches, run_compiled, run_reference, to_device)

TOKENS, DIM, VOCAB = 26, 16, 37
# 26 tokens in chunks of at most 5: six chunks of 5, the last padded by 4 ignored rows.
MAX_ROWS = 5
# The 16-long dots of the logits, then a log-sum-exp over 37 classes; for the gradient of the
# weight a sum over the 26 tokens.
RTOL = rtol_for(torch.float32, reduction=TOKENS, depth=2, functions=CROSS_ENTROPY_FUNCTIONS)


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, TOKENS // 2, DIM, generator=g)
    weight = torch.randn(VOCAB, DIM, generator=g) / DIM ** 0.5
    target = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=g)
    target[0, 3] = IGNORE_INDEX
    target[1, :4] = IGNORE_INDEX
    return hidden, weight, target


def _reference(hidden, weight, target):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1), target.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return (loss.detach(), *torch.autograd.grad(loss, [hidden, weight]))


def _assert_close(got, want):
    torch.testing.assert_close(got.cpu(), want, rtol=RTOL, atol=RTOL * float(want.abs().max()))


def _chunked(hidden, weight, target, device):
    hidden = hidden.to(device).requires_grad_()
    weight = weight.to(device).requires_grad_()
    loss = linear_cross_entropy_sum(hidden, weight, target.to(device), max_rows=MAX_ROWS)
    return (loss.detach(), *torch.autograd.grad(loss, [hidden, weight]))


@pytest.mark.parametrize("device", ["cpu", DEVICE], ids=["cpu", "tpu-eager"])
def test_loss_and_gradients_equal_the_full_logits(device):
    assert chunk_layout(TOKENS, MAX_ROWS) == (6, 5)
    operands = _operands()
    want = _reference(*operands)
    for got, expected in zip(_chunked(*operands, device), want):
        _assert_close(got, expected)
    with torch.no_grad():  # the loss alone, nothing differentiated
        hidden, weight, target = (t.to(device) for t in operands)
        _assert_close(linear_cross_entropy_sum(hidden, weight, target, max_rows=MAX_ROWS),
                      want[0])


def test_all_labels_ignored_is_a_zero_loss_and_zero_gradients():
    hidden, weight, target = _operands()
    loss, grad_hidden, grad_weight = _chunked(hidden, weight, torch.full_like(target, -100),
                                              "cpu")
    assert float(loss) == 0.0
    assert not grad_hidden.any() and not grad_weight.any()


def test_bf16_autocast_matches_the_bf16_logits_within_their_rounding():
    operands = _operands(1)
    want = _reference(*operands)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _chunked(*operands, "cpu")
    # bf16 operands (a rounding each) against float32 ones: the products accumulate in float32.
    rtol = rtol_for(torch.bfloat16, 1, 2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w, rtol=rtol, atol=rtol * float(w.abs().max()))


def test_chunk_rows_bound_the_float32_logits():
    assert chunk_rows_for(32000) == 2097 and chunk_rows_for(128256) == 523
    assert 4 * chunk_rows_for(128256) * 128256 <= 256 * 2**20
    assert chunk_layout(32768, 2097) == (16, 2048)
    assert chunk_layout(8192, 523) == (16, 512)


def test_bad_arguments_are_one_line_errors():
    hidden, weight, target = _operands()
    with pytest.raises(ValueError, match=r"weight \[vocab, dim\].*got hidden \(2, 13, 16\), "
                                         r"weight \(16, 37\)"):
        linear_cross_entropy_sum(hidden, weight.T, target)
    with pytest.raises(ValueError, match="max_rows must be >= 1, got 0"):
        linear_cross_entropy_sum(hidden, weight, target, max_rows=0)
    with pytest.raises(ValueError, match="must be a number of tokens >= 1"):
        set_chunk_tokens(0)


# ---------------------------------------------------------------------- the trainer's loss

def _tiny(tie: bool):
    return _llama(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96,
                  ffn_hidden_dim=64, max_seq_len=16, tie_embeddings=tie)


def _full_logits_loss(model, batch):
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum") / batch["labels"].numel()


def _chunked_loss(model, batch):
    return causal_lm_loss_sum(model, batch) / batch["labels"].numel()


def _batches():
    batches = lm_batches(2, batch=2, seq=16, vocab=96)
    batches[0]["labels"][0, :5] = IGNORE_INDEX
    return batches


@pytest.fixture
def small_chunks():
    set_chunk_tokens(6)  # 32 tokens: six chunks, the last padded by 4 rows
    yield
    set_chunk_tokens(None)


def test_output_weight_is_the_output_layer_or_the_tied_embedding():
    untied, tied = _tiny(False), _tiny(True)
    assert output_weight(untied) is untied.output.weight
    assert output_weight(tied) is tied.tok_embeddings.weight
    assert output_weight(torch.nn.Linear(3, 4)) is None  # no hidden_states: the logits


@pytest.mark.parametrize("tie, autodiff", [(False, "jax"), (True, "torch")],
                         ids=["untied-jax", "tied-torch"])
def test_compiled_steps_train_like_the_full_logits_on_the_cpu(small_chunks, tie, autodiff):
    batches = _batches()
    sgd = OPTIMIZERS["sgd"]
    expected, reference, _, _ = run_reference(_tiny(tie), sgd, _full_logits_loss, batches,
                                              device="cpu")
    metrics, model, _, _ = run_compiled(_tiny(tie), sgd, _chunked_loss, batches,
                                        autodiff=autodiff)
    assert_losses_close([m["loss"] for m in metrics], expected,
                        loss_rtol(torch.float32, 2, 96))
    assert_params_close(model, reference, update_rtol(torch.float32, 2, 96))


def test_the_lowered_step_holds_no_float32_logits_beyond_one_chunk(small_chunks):
    batch = to_device(_batches()[0])

    def float32_logits(loss_fn) -> set:
        model = _tiny(False).to(DEVICE)
        program = lower_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                                   batch, compile=False)
        return set(re.findall(r"tensor<((?:\d+x)+)96xf32>", program.lowered.as_text()))

    # 2 x 16 tokens: the full logits are [32, 96] (or [2, 16, 96]); a chunk [6, 96].
    assert float32_logits(_chunked_loss) == {"6x"}
    assert {"32x", "2x16x"} & float32_logits(_full_logits_loss)
