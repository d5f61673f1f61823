"""Lowerings of the multi-class margin losses and their backward ops.

``multi_margin_loss`` (``nn.MultiMarginLoss``) and ``multilabel_margin_loss``
(``nn.MultiLabelMarginLoss``) follow ATen's CPU kernels: a margin term counts only where it is
strictly positive (so its gradient at exactly 0 is 0, as the kernels' ``z > 0`` test gives,
not the 1/2 a ``maximum`` would), and ``multilabel`` reads each row's labels up to its first
-1. The backward ops are the exact pullbacks (``jax.vjp``) of these forwards.
"""

from __future__ import annotations

import jax.numpy as jnp

from tpu_train.ops.conv import _vjp_wrt_first
from tpu_train.ops.registry import aten, lowers

_NONE, _MEAN, _SUM = 0, 1, 2


def _positive_part(z):
    return jnp.where(z > 0, z, 0)


def _multi_margin(x, target, p, margin, weight, reduction):
    rows = jnp.atleast_2d(x)
    labels = target.reshape(-1, 1).astype(jnp.int32)
    classes = rows.shape[1]
    z = _positive_part(margin - jnp.take_along_axis(rows, labels, axis=1) + rows)
    if p == 2:
        z = z * z
    elif p != 1:
        raise ValueError("only p == 1 and p == 2 supported")
    if weight is not None:
        z = z * weight.reshape(-1)[labels]
    z = jnp.where(jnp.arange(classes) != labels, z, 0)
    if reduction == _MEAN:
        return jnp.mean(z)
    if reduction == _SUM:
        return jnp.sum(z) / classes
    return jnp.mean(z, axis=1).reshape(x.shape[:-1] if x.ndim == 2 else (1,))


def _multilabel_margin(x, target, reduction):
    rows, labels = jnp.atleast_2d(x), jnp.atleast_2d(target).astype(jnp.int32)
    classes = rows.shape[1]
    positions = jnp.arange(classes)
    end = jnp.min(jnp.where(labels == -1, positions, classes), axis=-1, keepdims=True)
    is_label = positions < end  # [N, slots]: the slots before the row's first -1
    label_values = jnp.take_along_axis(rows, jnp.where(is_label, labels, 0), axis=-1)
    is_target = jnp.any((positions[None, None, :] == labels[..., None])
                        & is_label[..., None], axis=1)  # [N, classes]
    # [N, slots, classes]: label slot j against class i, counted for real labels j and
    # non-target classes i.
    z = _positive_part(1.0 - label_values[..., None] + rows[:, None, :]) / classes
    z = jnp.where(is_label[..., None] & ~is_target[:, None, :], z, 0)
    per_row = jnp.sum(z, axis=(1, 2))
    if reduction == _MEAN:
        loss = jnp.mean(per_row)
    elif reduction == _SUM:
        loss = jnp.sum(per_row)
    else:
        loss = per_row.reshape(x.shape[:-1] if x.ndim == 2 else ())
    return loss, is_target.astype(x.dtype).reshape(target.shape)


def _input_gradient(forward, x, grad_output):
    # Shaped as grad_output: torch's meta result of the unreduced loss of one vector is [1]
    # where this forward's is [].
    return _vjp_wrt_first(lambda v: forward(v).reshape(grad_output.shape), x, grad_output)


@lowers(aten.multi_margin_loss.default)
def multi_margin_loss(self, target, p=1, margin=1, weight=None, reduction=_MEAN):
    return _multi_margin(self, target, p, margin, weight, reduction)


@lowers(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None,
                               reduction=_MEAN):
    return _input_gradient(lambda x: _multi_margin(x, target, p, margin, weight, reduction),
                           self, grad_output)


@lowers(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(self, target, reduction):
    return _multilabel_margin(self, target, reduction)


@lowers(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    return _input_gradient(lambda x: _multilabel_margin(x, target, reduction)[0], self,
                           grad_output)
