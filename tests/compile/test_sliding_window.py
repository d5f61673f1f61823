"""Mistral's sliding window on the tpu device: op by op and in compiled programs, at sequences
longer than the window, against transformers' MistralForCausalLM on the CPU (the oracle); the
same weights without the window must miss it. A v5e step of a sliding-window model lowers its
attention to the splash kernels with the window's LocalMask."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.models.hf_reference import MISTRAL_WINDOW, hf_mistral, random_tokens
from tpu_train.compile import compile_train_step, lower_train_step
from tpu_train.compile.evaluation import CompiledLoss
from tpu_train.models import Llama, from_pretrained
from tpu_train.ops import attention_tpu

from .helpers import DEVICE, OPTIMIZERS, lm_loss, run_reference, to_device
from tests.markers import needs_libtpu

SEQ = 32  # more than two windows
assert SEQ > 2 * MISTRAL_WINDOW


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' Mistral, ours loaded from its checkpoint)."""
    reference = hf_mistral()
    directory = tmp_path_factory.mktemp("mistral")
    reference.save_pretrained(directory)
    return reference, from_pretrained(directory).eval()


def _unwindowed(model):
    plain = Llama(dataclasses.replace(model.config, sliding_window=None)).eval()
    plain.load_state_dict(model.state_dict())
    return plain


def _relative(got, want) -> float:
    return float((got.detach().cpu().double() - want.double()).norm() / want.double().norm())


def test_eager_on_the_device_matches_transformers(pair):
    reference, model = pair
    tokens = random_tokens(2, SEQ)
    with torch.no_grad():
        expected = reference(tokens).logits
        got = copy.deepcopy(model).to(DEVICE)(tokens.to(DEVICE))
        without = _unwindowed(model).to(DEVICE)(tokens.to(DEVICE))
    assert _relative(got, expected) <= 1e-5
    assert _relative(without, expected) > 1e-2


def _summed_loss(model, batch):
    logits = model(batch["tokens"]).float()
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")


def test_a_compiled_program_matches_transformers(pair):
    """A compiled forward (the evaluation program) over tokens past the window gives
    transformers' summed cross-entropy; the unwindowed program does not."""
    reference, model = pair
    tokens = random_tokens(2, SEQ + 1, seed=1)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    with torch.no_grad():
        expected = float(_summed_loss(lambda t: reference(t).logits, batch))
    got = CompiledLoss(copy.deepcopy(model).to(DEVICE), _summed_loss)(batch)
    without = CompiledLoss(_unwindowed(model).to(DEVICE), _summed_loss)(batch)
    assert abs(got - expected) <= 1e-5 * abs(expected)
    assert abs(without - expected) > 1e-3 * abs(expected)


def test_a_compiled_step_follows_eager_pytorch(pair):
    """Forward and backward through the window: three AdamW steps compiled on the device give
    CPU PyTorch's losses, whose first is transformers' loss on the batch."""
    reference, model = pair
    batches = []
    for seed in range(3):
        tokens = random_tokens(2, SEQ + 1, seed=10 + seed)
        batches.append({"tokens": tokens[:, :-1].contiguous(),
                        "labels": tokens[:, 1:].contiguous()})
    train = copy.deepcopy(model).train()
    make_opt = OPTIMIZERS["adamw"]
    cpu_losses, *_ = run_reference(train, make_opt, lm_loss, batches, device="cpu")
    on_device = copy.deepcopy(train).to(DEVICE)
    step = compile_train_step(on_device, make_opt(on_device.parameters()), lm_loss)
    losses = [float(step(to_device(b))["loss"].cpu()) for b in batches]
    for got, want in zip(losses, cpu_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, cpu_losses)
    with torch.no_grad():
        first = float(lm_loss(lambda t: reference(t).logits, batches[0]))
    assert abs(losses[0] - first) <= 1e-5 * first




@needs_libtpu
def test_a_v5e_step_of_a_sliding_window_model_builds_the_local_kernels(monkeypatch):
    """Lowered for a v5e (compile-only), a bf16 step at 1024 tokens with a 256-token window:
    the compiled step declares the model's window, and the kernels its attention lowers to
    are built with it (forward and backward), beside the XLA form of the in-program check."""
    from tests.compile.test_attention_kernels import _meta_llama

    model, _, batch = _meta_llama(1024, 1)
    with torch.device("meta"):
        model = Llama(dataclasses.replace(model.config, sliding_window=256,
                                          hf_model_type="mistral"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    built = []
    make_kernel = attention_tpu._kernel
    monkeypatch.setattr(attention_tpu, "_kernel",
                        lambda *args: built.append(args) or make_kernel(*args))
    lowered = lower_train_step(model, optimizer, lm_loss, batch, target="v5e", compile=False,
                               autocast_dtype=torch.bfloat16, compute_dtype=torch.bfloat16)
    assert "@tpu_custom_call(" in lowered.lowered.as_text()
    assert built and {args[-1] for args in built} == {256}
