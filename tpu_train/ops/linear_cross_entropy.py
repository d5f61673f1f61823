"""The chunked ``F.linear_cross_entropy`` custom ops (``torch_nn::_linear_cross_entropy_*``).

``cross_entropy(input @ linear_weight.T + linear_bias, target)`` for class-index targets, with
class ``weight``, ``ignore_index`` and ``label_smoothing`` as ``F.cross_entropy`` defines them
(``mean`` divides both the NLL and the smoothing term by the summed weight of the targets that
count). PyTorch chunks the batch to bound the logits' memory; XLA sees the whole product at
once, so ``batch_chunk_size`` and the accumulation policy are accepted and not needed (the
logits are float32 for every input dtype).

The reducing op returns the loss and, computed in the same pass as the op's contract says,
the gradients of the loss for the inputs flagged ``compute_*_grad`` (empty ``(0, 0)`` /
``(0,)`` otherwise, as its fake kernel gives); its autograd formula scales them. The
``reduction='none'`` op returns the per-sample loss; its backward is PyTorch's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch.nn.modules.linear_cross_entropy  # noqa: F401  (defines the torch_nn ops)
from jax import lax

from tpu_train.ops.registry import lowers
from torch import ops

_OPS = ops.torch_nn


def _losses(x, linear_weight, target, linear_bias, weight, ignore_index, label_smoothing):
    """``(per-sample loss, per-sample target weight)`` in float32."""
    logits = jnp.dot(x, linear_weight.T, precision=lax.Precision.HIGHEST)
    if linear_bias is not None:
        logits = logits + linear_bias
    logp = jax.nn.log_softmax(logits, axis=-1)
    valid = target != ignore_index
    index = jnp.where(valid, target, 0).astype(jnp.int32)
    class_weight = jnp.ones(logits.shape[-1], logp.dtype) if weight is None else weight
    target_weight = jnp.where(valid, class_weight[index], 0)
    nll = -target_weight * jnp.take_along_axis(logp, index[:, None], axis=1)[:, 0]
    smooth = -jnp.where(valid, jnp.sum(logp * class_weight, axis=-1), 0) / logits.shape[-1]
    loss = (1 - label_smoothing) * nll + label_smoothing * smooth
    return loss, target_weight


def _rows(input, target):
    return input.reshape(-1, input.shape[-1]).astype(jnp.float32), target.reshape(-1)


@lowers(_OPS._linear_cross_entropy_batch_chunked.default)
def linear_cross_entropy_batch_chunked(input, linear_weight, target, linear_bias, weight,
                                       reduction, ignore_index, label_smoothing,
                                       batch_chunk_size, acc_policy, acc_dtype,
                                       allow_retain_graph, compute_input_grad,
                                       compute_linear_weight_grad, compute_linear_bias_grad):
    """``(loss, grad_input, grad_linear_weight, grad_linear_bias)`` for ``mean``/``sum``."""
    x, t = _rows(input, target)
    w = None if weight is None else weight.astype(jnp.float32)

    def total(x, lw, lb):
        loss, target_weight = _losses(x, lw, t, lb, w, ignore_index, label_smoothing)
        if reduction == "mean":
            return jnp.sum(loss) / jnp.sum(target_weight)
        return jnp.sum(loss)

    lw = linear_weight.astype(jnp.float32)
    lb = None if linear_bias is None else linear_bias.astype(jnp.float32)
    loss, (gx, gw, gb) = jax.value_and_grad(total, argnums=(0, 1, 2))(
        x, lw, jnp.zeros(lw.shape[:1], jnp.float32) if lb is None else lb)
    dtype = input.dtype
    grad_input = gx.reshape(input.shape) if compute_input_grad else jnp.zeros((0, 0))
    grad_weight = gw if compute_linear_weight_grad else jnp.zeros((0, 0))
    grad_bias = gb if compute_linear_bias_grad else jnp.zeros((0,))
    return (loss.astype(dtype), grad_input.astype(dtype), grad_weight.astype(dtype),
            grad_bias.astype(dtype))


@lowers(_OPS._linear_cross_entropy_batch_chunked_no_reduction.default)
def linear_cross_entropy_batch_chunked_no_reduction(input, linear_weight, target, linear_bias,
                                                    weight, ignore_index, batch_chunk_size,
                                                    acc_policy, acc_dtype):
    """The per-sample loss ``(N,)`` (no label smoothing on this path)."""
    x, t = _rows(input, target)
    lb = None if linear_bias is None else linear_bias.astype(jnp.float32)
    w = None if weight is None else weight.astype(jnp.float32)
    loss, _ = _losses(x, linear_weight.astype(jnp.float32), t, lb, w, ignore_index, 0.0)
    return loss.reshape(input.shape[:-1]).astype(input.dtype)
