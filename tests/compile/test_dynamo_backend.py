"""``torch.compile(model, backend="tpu")`` against eager tpu execution of the same model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tpu_train.compile  # noqa: F401  (registers the "tpu" backend)
from tests.compile.helpers import DEVICE, lm_batches, lm_loss, mlp, tiny_llama


def _train(model, forward, batches, loss_of, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches[:steps]:
        loss = loss_of(forward, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _mlp_batches(n):
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(8, 12, generator=g).to(DEVICE),
             "y": torch.randn(8, 5, generator=g).to(DEVICE)} for _ in range(n)]


def _mlp_loss(forward, batch):
    return F.mse_loss(forward(batch["x"]), batch["y"])


def test_mlp_inference_matches_eager():
    torch._dynamo.reset()
    model = mlp().to(DEVICE)
    x = torch.randn(8, 12).to(DEVICE)
    compiled = torch.compile(model, backend="tpu")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x).cpu(), model(x).cpu(), rtol=1e-5, atol=1e-5)


def test_mlp_training_matches_eager():
    torch._dynamo.reset()
    eager = mlp().to(DEVICE)
    model = copy.deepcopy(eager)
    batches = _mlp_batches(1) * 3  # one batch: the loss must fall
    compiled_losses = _train(model, torch.compile(model, backend="tpu"), batches, _mlp_loss, 3)
    eager_losses = _train(eager, eager, batches, _mlp_loss, 3)
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-5, atol=1e-6)
    assert compiled_losses[-1] < compiled_losses[0]
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-5, atol=1e-6)


def test_graph_break_runs_eager_between_compiled_regions():
    torch._dynamo.reset()
    model = mlp().to(DEVICE)
    seen = []

    def forward(x):
        h = model[1](model[0](x))
        seen.append(float(h.sum().item()))  # data-dependent host read: a graph break
        return model[4](model[3](model[2](h)))

    x = torch.randn(8, 12).to(DEVICE)
    with torch.no_grad():
        out = torch.compile(forward, backend="tpu")(x)
        torch.testing.assert_close(out.cpu(), model(x).cpu(), rtol=1e-5, atol=1e-5)
    assert len(seen) == 1


def test_tiny_llama_training_matches_eager():
    torch._dynamo.reset()
    eager = tiny_llama().to(DEVICE)
    model = copy.deepcopy(eager)
    batches = [{k: v.to(DEVICE) for k, v in b.items()} for b in lm_batches(1)] * 3
    compiled_losses = _train(model, torch.compile(model, backend="tpu"), batches, lm_loss, 3)
    eager_losses = _train(eager, eager, batches, lm_loss, 3)
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-4, atol=1e-5)
    assert compiled_losses[-1] < compiled_losses[0]
