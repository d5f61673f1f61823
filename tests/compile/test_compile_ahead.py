"""Programs compiled ahead of their first call (``compile_ahead``): XLA compiles on a thread of
its own, the first call waits for it, and the program and its results are the ones the call
would have built itself."""

from __future__ import annotations

import copy
import threading

import torch

from tpu_train.compile import CompiledDecoder
from tpu_train.compile.evaluation import CompiledLoss
from tpu_train.models import Llama, LlamaConfig
from tpu_train.models.generation import StaticCacheDecoding
from tpu_train.trainer.step import causal_lm_loss_sum

CONFIG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                     ffn_hidden_dim=64, max_seq_len=32)


def _model() -> torch.nn.Module:
    cpu = Llama(CONFIG)
    cpu.init_weights(seed=0, device="cpu")
    return copy.deepcopy(cpu).to("tpu").eval()


def _batch(seed: int, rows: int = 4, seq: int = 16) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (rows, seq), generator=g)
    labels = tokens.clone()
    labels[:, :3] = -100
    return {"tokens": tokens, "labels": labels}


def _compile_threads(monkeypatch) -> list:
    """The threads XLA compiles on, from now on."""
    import jax

    threads, compile = [], jax.stages.Lowered.compile

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread())
        return compile(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    return threads


def test_a_loss_compiled_ahead_is_the_same_program(monkeypatch):
    model = _model()
    at_call = CompiledLoss(model, causal_lm_loss_sum)
    expected = [at_call(_batch(seed)) for seed in (0, 1)]
    threads = _compile_threads(monkeypatch)
    ahead = CompiledLoss(model, causal_lm_loss_sum)
    assert ahead.compile_ahead(_batch(5))  # the shapes matter, not the values
    assert not ahead.compile_ahead(_batch(6))  # the same program: nothing more to start
    assert [ahead(_batch(seed)) for seed in (0, 1)] == expected  # bitwise
    assert len(threads) == 1 and threads[0] is not threading.main_thread()
    [record] = ahead.compilations
    assert record.waited_s is not None and record.compile_s > 0
    assert at_call.compilations[0].waited_s is None


def test_decoding_compiled_ahead_is_the_same_program(monkeypatch):
    model = _model()
    prompts = [[1, 5, 9], [2, 7, 7, 3, 4], [8]]
    at_call = CompiledDecoder(model, StaticCacheDecoding())
    expected = at_call.generate(prompts, 6, eos_token_id=2, batch_size=4)
    threads = _compile_threads(monkeypatch)
    ahead = CompiledDecoder(model, StaticCacheDecoding())
    assert ahead.compile_ahead(prompts[:1], 6, eos_token_id=2, batch_size=4)
    assert torch.equal(ahead.generate(prompts, 6, eos_token_id=2, batch_size=4), expected)
    assert len(threads) == 1 and threads[0] is not threading.main_thread()
    [record] = ahead.compilations
    assert record.waited_s is not None
