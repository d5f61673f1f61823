"""``multi_margin_loss`` and ``multilabel_margin_loss`` on the tpu device: losses and input
gradients against CPU PyTorch, through the user's path (``F.*`` then ``backward()``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpu_train  # noqa: F401  (registers the tpu device)

G = torch.Generator().manual_seed(0)
X = torch.randn(4, 5, generator=G)
X[0, 2] = X[0, 1] - 1.0  # a margin term exactly 0: CPU's gradient there is 0
LABELS = torch.tensor([1, 0, 4, 2])
WEIGHT = torch.rand(5, generator=G) + 0.5
MULTILABEL = torch.tensor([[1, 3, -1, 0, 2],   # labels 1 and 3, the rest ignored after -1
                           [0, 0, -1, -1, -1],  # a label given twice
                           [-1, 1, 2, 3, 4],    # no label
                           [4, 3, 2, 1, 0]])    # every class a label: no loss


def _loss_and_grad(fn, x, *args, **kwargs):
    x = x.clone().requires_grad_()
    loss = fn(x, *args, **kwargs)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), x.grad


def _on_both(fn, x, *args, **kwargs):
    cpu = _loss_and_grad(fn, x, *args, **kwargs)
    moved = [a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args]
    kw = {k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    tpu = _loss_and_grad(fn, x.to("tpu"), *moved, **kw)
    return cpu, tuple(t.cpu() for t in tpu)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_multi_margin_loss_matches_cpu(reduction, p, weighted):
    weight = WEIGHT if weighted else None
    (want, want_grad), (got, grad) = _on_both(F.multi_margin_loss, X, LABELS, p=p, margin=0.7,
                                              weight=weight, reduction=reduction)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, want_grad)
    assert want_grad[0, 2] == 0 and grad[0, 2] == 0


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_multi_margin_loss_of_one_vector_matches_cpu(reduction):
    (want, want_grad), (got, grad) = _on_both(F.multi_margin_loss, X[1], LABELS[2:3],
                                              reduction=reduction)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, want_grad)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_multilabel_margin_loss_matches_cpu(reduction):
    (want, want_grad), (got, grad) = _on_both(F.multilabel_margin_loss, X, MULTILABEL,
                                              reduction=reduction)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, want_grad)
    assert torch.count_nonzero(want_grad[3]) == 0


def test_multilabel_margin_loss_of_one_vector_matches_cpu():
    (want, want_grad), (got, grad) = _on_both(F.multilabel_margin_loss, X[0], MULTILABEL[0],
                                              reduction="none")
    # The CPU kernel returns a 0-dim loss, torch's meta kernel (which gives the tpu result its
    # shape, as it gives torch.compile's) a 1-element vector: the same value.
    assert want.shape == () and got.shape == (1,)
    torch.testing.assert_close(got, want.reshape(1))
    torch.testing.assert_close(grad, want_grad)


def test_is_target_output_matches_cpu():
    want = torch.ops.aten.multilabel_margin_loss_forward(X, MULTILABEL, 1)
    got = torch.ops.aten.multilabel_margin_loss_forward(X.to("tpu"), MULTILABEL.to("tpu"), 1)
    torch.testing.assert_close(got[0].cpu(), want[0])
    torch.testing.assert_close(got[1].cpu(), want[1])
