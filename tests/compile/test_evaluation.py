"""CompiledLoss: a model's loss over one batch as one program, against PyTorch on the CPU."""

from __future__ import annotations

import copy

import torch

from tests.tolerances import loss_rtol
from tpu_train.compile.evaluation import CompiledLoss
from tpu_train.models import Llama, LlamaConfig
from tpu_train.trainer.step import causal_lm_loss_sum

from .helpers import lm_functions

FUNCTIONS = lm_functions(2)  # the 2-layer Llama below and its cross-entropy


def _batch(seed: int, rows: int, seq: int = 16):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (rows, seq), generator=g)
    labels = tokens.clone()
    labels[:, :3] = -100  # ignored positions, as a prompt mask leaves them
    return {"tokens": tokens, "labels": labels}


def test_compiled_loss_matches_cpu_and_compiles_once_per_shape():
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                      ffn_hidden_dim=64, max_seq_len=16)
    cpu = Llama(cfg)
    cpu.init_weights(seed=0, device="cpu")
    cpu.eval()
    model = copy.deepcopy(cpu).to("tpu").eval()
    loss = CompiledLoss(model, causal_lm_loss_sum)
    for seed, rows in ((0, 4), (1, 4), (2, 2)):
        batch = _batch(seed, rows)
        with torch.no_grad():
            expected = float(causal_lm_loss_sum(cpu, batch))
        got = loss(batch)
        # One forward and a sum over rows * 13 labelled tokens (depth: the layers), with the
        # layers' and the cross-entropy's elementwise functions.
        rtol = loss_rtol(torch.float32, 1, rows * 13, depth=2, functions=FUNCTIONS)
        assert abs(got - expected) <= rtol * abs(expected)
    assert len(loss.compilations) == 2  # batches of 4 rows, then of 2
    # The weights are program inputs: a new state of the model is evaluated without a compile.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
        for p in cpu.parameters():
            p.mul_(0.5)
        expected = float(causal_lm_loss_sum(cpu, _batch(3, 4)))
    got = loss(_batch(3, 4))
    rtol = loss_rtol(torch.float32, 1, 4 * 13, depth=2, functions=FUNCTIONS)
    assert abs(got - expected) <= rtol * abs(expected)
    assert len(loss.compilations) == 2


def test_summed_loss_over_pieces_of_rows_matches_cpu():
    """``rows_per_piece``: the program sums the loss over pieces of that many rows in a loop
    (the validation of ``tpu-train`` with ``trainer.micro_batch_size``): the same sum as
    PyTorch's over the whole batch; a batch the piece size does not divide runs whole."""
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                      ffn_hidden_dim=64, max_seq_len=16)
    cpu = Llama(cfg)
    cpu.init_weights(seed=1, device="cpu")
    cpu.eval()
    model = copy.deepcopy(cpu).to("tpu").eval()
    loss = CompiledLoss(model, causal_lm_loss_sum, rows_per_piece=2)
    for seed, rows, pieces in ((0, 8, 4), (1, 3, 1)):
        batch = _batch(seed, rows)
        assert loss.pieces(list(batch.values())) == pieces
        with torch.no_grad():
            expected = float(causal_lm_loss_sum(cpu, batch))
        got = loss(batch)
        rtol = loss_rtol(torch.float32, 1, rows * 13, depth=2, functions=FUNCTIONS)
        assert abs(got - expected) <= rtol * abs(expected), (rows, got, expected)
    assert len(loss.compilations) == 2
