"""Eager training on tpu matches PyTorch on CPU: 20 steps, SGD and AdamW on every optimizer path."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpu_train
from tpu_train.device import lazy
from tests.tolerances import (CROSS_ENTROPY_FUNCTIONS, loss_rtol, param_atol, rtol_for,
                             update_rtol)

STEPS = 20


class Block(nn.Module):
    """A small pre-norm transformer block with a token embedding and an LM head."""

    def __init__(self, vocab=64, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.embed = nn.Embedding(vocab, dim)
        self.norm1 = nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        b, s = tokens.shape
        x = self.embed(tokens)
        h = self.norm1(x)
        q = self.wq(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(h).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * F.gelu(up))
        return self.head(x)


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _mlp_batches(device):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device))
            for _ in range(STEPS)]


def _block_batches(device):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (2, 12), generator=g).to(device) for _ in range(STEPS)]


def _mlp_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _block_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


OPTIMIZERS = {
    "sgd": lambda p, **kw: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01, **kw),
    "adamw": lambda p, **kw: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, **kw),
}
PATHS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
MODELS = {"mlp": (_mlp, _mlp_batches, _mlp_loss), "block": (Block, _block_batches, _block_loss)}
# Longest reduction per step (forward and backward, float32): the MLP's hidden width 32; the
# block's up-projection width 64 = its vocabulary (other reductions: dim 32, 2 x 11 tokens).
REDUCTION = {"mlp": 32, "block": 64}
# The elementwise functions along each model's forward and its cross-entropy loss (the MLP's
# GELU; the block's RMSNorm and LayerNorm, attention softmax, SiLU and GELU): each adds its
# measured error (on a TPU, the loss's log 1370 u, the softmax's exp 82 u).
FUNCTIONS = {"mlp": ("erf", *CROSS_ENTROPY_FUNCTIONS),
             "block": ("rsqrt", "rsqrt", "exp", "sigmoid", "erf", *CROSS_ENTROPY_FUNCTIONS)}


def _rms(t):
    return float(t.detach().cpu().double().norm()) / max(t.numel(), 1) ** 0.5


def _train(model, make_optimizer, batches, loss_fn):
    optimizer = make_optimizer(model.parameters())
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("model_name", MODELS)
def test_losses_match_cpu(model_name, optimizer, path, mode):
    make_model, make_batches, loss_fn = MODELS[model_name]
    torch.manual_seed(0)
    cpu_model = make_model()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    initial = copy.deepcopy(cpu_model)
    make_optimizer = lambda params: OPTIMIZERS[optimizer](params, **PATHS[path])  # noqa: E731
    expected = _train(cpu_model, make_optimizer, make_batches("cpu"), loss_fn)
    before = lazy.stats()
    with tpu_train.eager_mode(mode):
        got = _train(tpu_model, make_optimizer, make_batches("tpu"), loss_fn)
    after = lazy.stats()
    if mode == "fused":  # each step is recorded and runs as one region at loss.item() ...
        assert after["regions_run"] - before["regions_run"] >= STEPS
        # ... whose program is compiled for the first steps only (optimizer state creation)
        assert after["programs_compiled"] - before["programs_compiled"] <= 3
    # float32, STEPS steps, longest reduction REDUCTION[model_name] (tests/tolerances.py).
    n, functions = REDUCTION[model_name], FUNCTIONS[model_name]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected),
                               rtol=loss_rtol(torch.float32, STEPS, n, functions=functions),
                               atol=0)
    lr = make_optimizer([nn.Parameter(torch.zeros(1))]).param_groups[0]["lr"]
    for (name, p_cpu), p_tpu, p0 in zip(cpu_model.named_parameters(), tpu_model.parameters(),
                                        initial.parameters()):
        assert p_tpu.device.type == "tpu", name
        if optimizer == "adamw":  # RMS bound relative to the total update lr * STEPS
            limit = param_atol(torch.float32, lr, STEPS, reduction=n, numel=p_cpu.numel(),
                               functions=functions)
        else:  # SGD is linear in the gradient: relative to the accumulated update
            limit = update_rtol(torch.float32, STEPS, n, functions=functions) * _rms(p_cpu - p0)
        err = _rms(p_tpu.cpu() - p_cpu)
        assert err <= limit, f"{name}: RMS difference {err:.2e} > {limit:.2e}"


class _ScaledSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * x * scale

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 * x * ctx.scale, None


def test_custom_autograd_function():
    x_cpu = torch.randn(5, requires_grad=True)
    x_tpu = x_cpu.detach().to("tpu").requires_grad_()
    _ScaledSquare.apply(x_cpu, 3.0).sum().backward()
    _ScaledSquare.apply(x_tpu, 3.0).sum().backward()
    assert x_tpu.grad.device.type == "tpu"
    torch.testing.assert_close(x_tpu.grad.cpu(), x_cpu.grad)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing(use_reentrant):
    torch.manual_seed(0)
    cpu_model = _mlp()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    x = torch.randn(4, 16, requires_grad=use_reentrant)
    out_cpu = torch.utils.checkpoint.checkpoint(cpu_model, x, use_reentrant=use_reentrant)
    out_tpu = torch.utils.checkpoint.checkpoint(tpu_model, x.detach().to("tpu").requires_grad_(use_reentrant),
                                                use_reentrant=use_reentrant)
    out_cpu.square().sum().backward()
    out_tpu.square().sum().backward()
    # One forward and backward in float32, longest reduction the hidden width 32.
    for p_cpu, p_tpu in zip(cpu_model.parameters(), tpu_model.parameters()):
        err = _rms(p_tpu.grad.cpu() - p_cpu.grad) / _rms(p_cpu.grad)
        assert err <= rtol_for(torch.float32, 32), err


def test_seed_snippet_shape():
    d = tpu_train.device(0)
    m = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).to(d)
    out = m(torch.randn(32, 256, device=d))
    assert out.shape == torch.Size([32, 256]) and out.device == d


def test_cnn_with_batchnorm_pooling_and_dropout_matches_cpu():
    torch.manual_seed(0)
    cpu_model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, stride=2), nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Dropout(0.0), nn.Linear(8, 10))
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g))
               for _ in range(5)]
    make_optimizer = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    expected = _train(cpu_model, make_optimizer, batches, _mlp_loss)
    got = _train(tpu_model, make_optimizer, [(x.to("tpu"), y.to("tpu")) for x, y in batches], _mlp_loss)
    # float32, 5 steps; the longest reduction is BatchNorm's statistics over 4 x 16 x 16 values
    # (the convolutions reduce 8 x 3 x 3 = 72); BatchNorm's rsqrt and the cross-entropy.
    functions = ("rsqrt", *CROSS_ENTROPY_FUNCTIONS)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected),
                               rtol=loss_rtol(torch.float32, 5, 4 * 16 * 16, functions=functions),
                               atol=0)
    torch.testing.assert_close(tpu_model[1].running_var.cpu(), cpu_model[1].running_var)
    cpu_model.eval(), tpu_model.eval()
    x = torch.randn(2, 3, 16, 16, generator=g)
    # The 5 steps' parameters, then one more forward; logits pass through zero, so the atol is
    # that relative error of the logits' size.
    expected = cpu_model(x)
    rtol = loss_rtol(torch.float32, 6, 4 * 16 * 16, functions=functions)
    torch.testing.assert_close(tpu_model(x.to("tpu")).cpu(), expected, rtol=rtol,
                               atol=rtol * expected.abs().max().item())


def test_dropout_trains_and_is_reproducible_with_a_seed():
    x = torch.ones(1000, device="tpu")
    torch.manual_seed(7)
    a = torch.nn.functional.dropout(x, 0.3).cpu()
    torch.manual_seed(7)
    b = torch.nn.functional.dropout(x, 0.3).cpu()
    c = torch.nn.functional.dropout(x, 0.3).cpu()
    assert torch.equal(a, b) and not torch.equal(b, c)
    kept = (a != 0).float().mean().item()
    assert 0.6 < kept < 0.8
    torch.testing.assert_close(a[a != 0], torch.full_like(a[a != 0], 1 / 0.7))
