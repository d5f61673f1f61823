"""``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` in ``eval()`` + ``no_grad`` take
PyTorch's fused fast path on the tpu device: its kernels are lowered and match the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tpu_train  # noqa: F401  (registers the tpu device)
from tests.tolerances import rtol_for

DIM, HEADS, FFN = 16, 4, 32
PADDING = torch.tensor([[False] * 5, [False, False, False, True, True]])
CAUSAL = torch.nn.Transformer.generate_square_subsequent_mask(5).bool()


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func)
        return func(*args, **(kwargs or {}))


def _on_tpu(module, *args, **kwargs):
    """(outputs of a copy of ``module`` on tpu, as CPU tensors; the aten ops it dispatched)."""
    moved = copy.deepcopy(module).to("tpu")
    # One tpu tensor per CPU tensor: self-attention's fast path needs ``query is key is value``.
    copies = {id(v): v.to("tpu") for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)}
    to_tpu = lambda v: copies.get(id(v), v)  # noqa: E731
    with torch.no_grad(), _RecordOps() as ops:
        out = moved(*map(to_tpu, args), **{k: to_tpu(v) for k, v in kwargs.items()})
    outs = out if isinstance(out, tuple) else (out,)
    return tuple(o.cpu() if o is not None else None for o in outs), ops.seen


def _assert_close(got, expected, depth):
    torch.testing.assert_close(got, expected, atol=1e-6,
                               rtol=rtol_for(torch.float32, reduction=FFN, depth=depth))


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("mask", ["none", "padding", "causal"])
def test_encoder_layer_fast_path_matches_cpu(norm_first, activation, mask):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(DIM, HEADS, FFN, batch_first=True, dropout=0.1,
                                             norm_first=norm_first, activation=activation).eval()
    x = torch.randn(2, 5, DIM)
    kwargs = {"none": {}, "padding": {"src_key_padding_mask": PADDING},
              "causal": {"src_mask": CAUSAL}}[mask]
    with torch.no_grad():
        expected = layer(x, **kwargs)
    (got,), ops = _on_tpu(layer, x, **kwargs)
    assert torch.ops.aten._transformer_encoder_layer_fwd.default in ops
    _assert_close(got, expected, depth=4)


@pytest.mark.parametrize("need_weights, average", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("padding", [False, True], ids=["dense", "padded"])
def test_multi_head_attention_fast_path_matches_cpu(need_weights, average, padding):
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(DIM, HEADS, batch_first=True).eval()
    x = torch.randn(2, 5, DIM)
    kwargs = {"need_weights": need_weights, "average_attn_weights": average}
    if padding:
        kwargs["key_padding_mask"] = PADDING
    with torch.no_grad():
        expected = attention(x, x, x, **kwargs)
    got, ops = _on_tpu(attention, x, x, x, **kwargs)
    assert torch.ops.aten._native_multi_head_attention.default in ops
    _assert_close(got[0], expected[0], depth=3)
    if need_weights:
        _assert_close(got[1], expected[1], depth=2)
    else:
        # CPU returns None; the tpu dispatch builds its outputs from the op's meta kernel,
        # which gives an empty tensor for the unrequested weights.
        assert expected[1] is None and got[1].numel() == 0


def test_stacked_encoder_without_padding_matches_cpu():
    torch.manual_seed(0)
    encoder = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(DIM, HEADS, FFN, batch_first=True), 2).eval()
    x = torch.randn(2, 5, DIM)
    with torch.no_grad():
        expected = encoder(x)
    (got,), _ = _on_tpu(encoder, x)
    _assert_close(got, expected, depth=8)


@pytest.mark.parametrize("mask", [False, True], ids=["dense", "causal_and_padded"])
def test_multi_head_attention_training_step_matches_cpu(mask):
    # The OpInfo entry of multi_head_attention_forward samples dropout_p=0.5, so its values
    # cannot be compared with the CPU's; the same op without dropout, forward and gradients:
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(DIM, HEADS, batch_first=True, bias=True,
                                            add_bias_kv=True).train()
    moved = copy.deepcopy(attention).to("tpu")
    x = torch.randn(2, 5, DIM)
    kwargs = {"attn_mask": CAUSAL, "key_padding_mask": PADDING} if mask else {}
    grads = []
    for module, device in ((attention, "cpu"), (moved, "tpu")):
        inputs = x.clone().to(device).requires_grad_()
        extra = {k: v.to(device) for k, v in kwargs.items()}
        out, weights = module(inputs, inputs, inputs, **extra)
        (out.square().sum() + weights.sum()).backward()
        grads.append([inputs.grad.cpu(), *(p.grad.cpu() for p in module.parameters())])
    assert len(grads[0]) == len(grads[1]) == 7
    for got, expected in zip(grads[1], grads[0]):
        _assert_close(got, expected, depth=4)
