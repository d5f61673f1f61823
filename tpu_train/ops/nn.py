"""Lowerings of neural-network building blocks: softmax, normalisations, embedding, losses.

Low-precision inputs (bf16 / f16) are computed in f32, as PyTorch's CPU kernels do; the caller
casts each result to the dtype torch predicts. Backward ops return ``None`` for an output that
``output_mask`` turns off (torch returns an undefined tensor there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from tpu_train.ops.registry import aten, lowers

_REDUCTION_NONE, _REDUCTION_MEAN, _REDUCTION_SUM = 0, 1, 2


def _compute_dtype(x):
    """f32 for low-precision floats, the dtype itself otherwise."""
    if x.dtype in (jnp.bfloat16, jnp.float16):
        return jnp.float32
    return x.dtype


def _up(x):
    return None if x is None else x.astype(_compute_dtype(x))


def _empty(dtype=jnp.float32):
    return jnp.zeros((0,), dtype)


# --- softmax ---------------------------------------------------------------------------------


def _softmax_backward(g, y, axis):
    return y * (g - jnp.sum(g * y, axis=axis, keepdims=True))


def _log_softmax_backward(g, y, axis):
    return g - jnp.exp(y) * jnp.sum(g, axis=axis, keepdims=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def softmax_along(x, axis, empty_rows_to_zero=False):
    """Softmax of ``x`` along ``axis``; with ``empty_rows_to_zero`` a row of all ``-inf`` gives
    zeros (torch's safe softmax), otherwise NaN (torch's softmax).

    Its JAX derivative is PyTorch's softmax backward, ``y * (g - sum(g * y))``, computed as the
    backward lowering computes it: differentiating the formula instead would also carry a
    gradient through the row max (a one-hot of each row's maximum, zero in exact arithmetic)
    and through the division.
    """
    row_max = jnp.max(x, axis=axis, keepdims=True)
    if empty_rows_to_zero:
        row_max = jnp.where(jnp.isneginf(row_max), 0, row_max)
    e = jnp.exp(x - row_max)
    total = jnp.sum(e, axis=axis, keepdims=True)
    if empty_rows_to_zero:
        return jnp.where(total == 0, 0, e / jnp.where(total == 0, 1, total))
    return e / total


def _softmax_along_forward(x, axis, empty_rows_to_zero):
    y = softmax_along(x, axis, empty_rows_to_zero)
    return y, y


softmax_along.defvjp(_softmax_along_forward,
                     lambda axis, empty_rows_to_zero, y, g: (_softmax_backward(g, y, axis),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def log_softmax_along(x, axis):
    """Log-softmax of ``x`` along ``axis``, whose JAX derivative is PyTorch's log-softmax
    backward, ``g - exp(y) * sum(g)`` (see ``softmax_along``)."""
    shifted = x - jnp.max(x, axis=axis, keepdims=True)
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True))


def _log_softmax_along_forward(x, axis):
    y = log_softmax_along(x, axis)
    return y, y


log_softmax_along.defvjp(_log_softmax_along_forward,
                         lambda axis, y, g: (_log_softmax_backward(g, y, axis),))


@lowers(aten._softmax.default)
def softmax(self, dim, half_to_float):
    return softmax_along(_up(self), dim)


@lowers(aten._log_softmax.default)
def log_softmax(self, dim, half_to_float):
    return log_softmax_along(_up(self), dim)


@lowers(aten._safe_softmax.default)
def safe_softmax(self, dim, dtype=None):
    """Softmax whose fully masked rows (all ``-inf``) give zeros instead of NaN."""
    return softmax_along(_up(self), dim, True)


@lowers(aten._softmax_backward_data.default)
def softmax_backward_data(grad_output, output, dim, input_dtype):
    return _softmax_backward(_up(grad_output), _up(output), dim)


@lowers(aten._log_softmax_backward_data.default)
def log_softmax_backward_data(grad_output, output, dim, input_dtype):
    return _log_softmax_backward(_up(grad_output), _up(output), dim)


# --- layer norm and RMS norm -----------------------------------------------------------------


def _trailing_axes(x, normalized_shape):
    return tuple(range(x.ndim - len(normalized_shape), x.ndim))


def _leading_axes(x, normalized_shape):
    return tuple(range(x.ndim - len(normalized_shape)))


def _normalized_input_grad(g, xhat, rstd, axes, center):
    """d(loss)/dx of ``xhat = (x - mean) * rstd`` given ``g = d(loss)/d(xhat)``."""
    projected = g - xhat * jnp.mean(g * xhat, axis=axes, keepdims=True)
    if center:
        projected = projected - jnp.mean(g, axis=axes, keepdims=True)
    return rstd * projected


@lowers(aten.native_layer_norm.default)
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    x = _up(input)
    axes = _trailing_axes(x, normalized_shape)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    rstd = lax.rsqrt(jnp.mean(centered * centered, axis=axes, keepdims=True) + eps)
    out = centered * rstd
    if weight is not None:
        out = out * _up(weight)
    if bias is not None:
        out = out + _up(bias)
    return out, mean, rstd


@lowers(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    x, g_out, mean, rstd = _up(input), _up(grad_out), _up(mean), _up(rstd)
    axes, lead = _trailing_axes(x, normalized_shape), _leading_axes(x, normalized_shape)
    xhat = (x - mean) * rstd
    g = g_out * _up(weight) if weight is not None else g_out
    grad_input = _normalized_input_grad(g, xhat, rstd, axes, center=True) if output_mask[0] else None
    grad_weight = jnp.sum(g_out * xhat, axis=lead) if output_mask[1] and weight is not None else None
    grad_bias = jnp.sum(g_out, axis=lead) if output_mask[2] and bias is not None else None
    return grad_input, grad_weight, grad_bias


def _rms_eps(input, eps):
    # torch defaults to the machine epsilon of the input's dtype.
    return jnp.finfo(input.dtype).eps if eps is None else eps


@lowers(aten._fused_rms_norm.default)
def fused_rms_norm(input, normalized_shape, weight, eps):
    x = _up(input)
    axes = _trailing_axes(x, normalized_shape)
    rstd = lax.rsqrt(jnp.mean(x * x, axis=axes, keepdims=True) + _rms_eps(input, eps))
    out = x * rstd
    if weight is not None:
        out = out * _up(weight)
    return out, rstd


@lowers(aten._fused_rms_norm_backward.default)
def fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    x, g_out, rstd = _up(input), _up(grad_out), _up(rstd)
    axes, lead = _trailing_axes(x, normalized_shape), _leading_axes(x, normalized_shape)
    xhat = x * rstd
    g = g_out * _up(weight) if weight is not None else g_out
    grad_input = _normalized_input_grad(g, xhat, rstd, axes, center=False) if output_mask[0] else None
    grad_weight = jnp.sum(g_out * xhat, axis=lead) if output_mask[1] and weight is not None else None
    return grad_input, grad_weight


# --- group norm ------------------------------------------------------------------------------


def _channel_shape(x):
    """Broadcast shape of a per-channel vector against an ``[N, C, *spatial]`` input."""
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


@lowers(aten.native_group_norm.default)
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = _up(input).reshape(N, group, C // group * HxW)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    rstd = lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    out = (centered * rstd).reshape(input.shape)
    if weight is not None:
        out = out * _up(weight).reshape(_channel_shape(input))
    if bias is not None:
        out = out + _up(bias).reshape(_channel_shape(input))
    return out, mean[..., 0], rstd[..., 0]


@lowers(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    grouped = (N, group, C // group, HxW)
    x, g_out = _up(input).reshape(grouped), _up(grad_out).reshape(grouped)
    mean, rstd = _up(mean)[:, :, None, None], _up(rstd)[:, :, None, None]
    xhat = (x - mean) * rstd
    g = g_out * _up(weight).reshape(1, group, C // group, 1) if weight is not None else g_out
    grad_input = None
    if output_mask[0]:
        grad_input = _normalized_input_grad(g, xhat, rstd, (2, 3), center=True).reshape(input.shape)
    grad_weight = jnp.sum(g_out * xhat, axis=(0, 3)).reshape(C) if output_mask[1] else None
    grad_bias = jnp.sum(g_out, axis=(0, 3)).reshape(C) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


# --- batch norm ------------------------------------------------------------------------------


def _batch_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _per_channel(v, x):
    return _up(v).reshape(_channel_shape(x))


def _batch_norm_apply(x, mean, invstd, weight, bias):
    out = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        out = out * _per_channel(weight, x)
    if bias is not None:
        out = out + _per_channel(bias, x)
    return out


def _batch_statistics(x, eps):
    axes = _batch_axes(x)
    mean = jnp.mean(x, axis=axes)
    centered = x - mean.reshape(_channel_shape(x))
    var = jnp.mean(centered * centered, axis=axes)
    return mean, var, lax.rsqrt(var + eps)


@lowers(aten._native_batch_norm_legit_functional.default)
def native_batch_norm_legit_functional(input, weight, bias, running_mean, running_var, training,
                                       momentum, eps):
    """Batch norm that returns the updated running statistics instead of writing them."""
    x = _up(input)
    if not training:
        invstd = lax.rsqrt(_up(running_var) + eps)
        out = _batch_norm_apply(x, running_mean, invstd, weight, bias)
        return out, _empty(), _empty(), running_mean, running_var
    mean, var, invstd = _batch_statistics(x, eps)
    count = x.size // x.shape[1]
    # Running variance tracks the unbiased estimate (Bessel's correction), as torch does.
    unbiased = var * (count / max(count - 1, 1))
    new_mean = (1 - momentum) * _up(running_mean) + momentum * mean
    new_var = (1 - momentum) * _up(running_var) + momentum * unbiased
    out = _batch_norm_apply(x, mean, invstd, weight, bias)
    return out, mean, invstd, new_mean, new_var


@lowers(aten._native_batch_norm_legit.no_stats)
def native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    x = _up(input)
    mean, _, invstd = _batch_statistics(x, eps)
    return _batch_norm_apply(x, mean, invstd, weight, bias), mean, invstd


@lowers(aten._native_batch_norm_legit_no_training.default)
def native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    x = _up(input)
    invstd = lax.rsqrt(_up(running_var) + eps)
    return _batch_norm_apply(x, running_mean, invstd, weight, bias), _empty(), _empty()


@lowers(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
                               save_invstd, train, eps, output_mask):
    x, g_out = _up(input), _up(grad_out)
    axes = _batch_axes(x)
    if train:
        mean, invstd = _up(save_mean), _up(save_invstd)
    else:
        mean, invstd = _up(running_mean), lax.rsqrt(_up(running_var) + eps)
    invstd_b = invstd.reshape(_channel_shape(x))
    xhat = (x - mean.reshape(_channel_shape(x))) * invstd_b
    g = g_out * _per_channel(weight, x) if weight is not None else g_out
    grad_input = None
    if output_mask[0]:
        if train:
            grad_input = _normalized_input_grad(g, xhat, invstd_b, axes, center=True)
        else:
            grad_input = g * invstd_b
    grad_weight = jnp.sum(g_out * xhat, axis=axes) if output_mask[1] else None
    grad_bias = jnp.sum(g_out, axis=axes) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


# --- embedding -------------------------------------------------------------------------------


@lowers(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    # XLA's gather clamps indices natively, so "clip" adds no masking work.
    return jnp.take(weight, indices, axis=0, mode="clip")


@lowers(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat_indices = indices.reshape(-1)
    grad = _up(grad_output).reshape(flat_indices.shape[0], -1)
    if padding_idx >= 0:
        grad = jnp.where((flat_indices == padding_idx)[:, None], 0, grad)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), grad.dtype).at[flat_indices].add(1, mode="drop")
        grad = grad / jnp.take(counts, flat_indices, mode="clip")[:, None]
    return jnp.zeros((num_weights, grad.shape[1]), grad.dtype).at[flat_indices].add(grad, mode="drop")


# --- losses ----------------------------------------------------------------------------------


def _reduce(loss, reduction):
    if reduction == _REDUCTION_MEAN:
        return jnp.mean(loss)
    if reduction == _REDUCTION_SUM:
        return jnp.sum(loss)
    return loss


def _mean_scale(grad, reduction, numel):
    return grad / numel if reduction == _REDUCTION_MEAN else grad


def _class_one_hot(target, ignore_index, num_classes, class_axis):
    """One-hot of ``target`` along ``class_axis`` (zero where ignored), built with an iota compare."""
    expanded = jnp.expand_dims(target, class_axis)
    iota_shape = (1,) * class_axis + (num_classes,) + (1,) * (target.ndim - class_axis)
    classes = lax.broadcasted_iota(jnp.int32, iota_shape, class_axis)
    return (expanded == classes) & (expanded != ignore_index)


def _nll_sample_weights(target, weight, ignore_index):
    valid = target != ignore_index
    if weight is None:
        return valid.astype(jnp.float32)
    safe = jnp.where(valid, target, 0)
    return jnp.where(valid, jnp.take(_up(weight), safe, mode="clip"), 0)


def _nll_forward(self, target, weight, reduction, ignore_index):
    x = _up(self)
    class_axis = 0 if x.ndim == 1 else 1
    sample_weight = _nll_sample_weights(target, weight, ignore_index).astype(x.dtype)
    picked = jnp.sum(jnp.where(_class_one_hot(target, ignore_index, x.shape[class_axis], class_axis), x, 0),
                     axis=class_axis)
    loss = -picked * sample_weight
    if reduction == _REDUCTION_NONE and x.ndim > 1:
        return loss, jnp.zeros((), x.dtype)
    total_weight = jnp.sum(sample_weight)
    if reduction == _REDUCTION_MEAN:
        return jnp.sum(loss) / total_weight, total_weight
    return jnp.sum(loss), total_weight


def _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    class_axis = 0 if self.ndim == 1 else 1
    g = _up(grad_output)
    sample_weight = _nll_sample_weights(target, weight, ignore_index).astype(g.dtype)
    if reduction == _REDUCTION_MEAN:
        sample_weight = sample_weight / _up(total_weight)
    if reduction != _REDUCTION_NONE or self.ndim == 1:
        g = g.reshape(())
    scaled = jnp.expand_dims(-sample_weight * g, class_axis)
    one_hot = _class_one_hot(target, ignore_index, self.shape[class_axis], class_axis)
    return jnp.where(one_hot, scaled, 0)


@lowers(aten.nll_loss_forward.default)
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    return _nll_forward(self, target, weight, reduction, ignore_index)


@lowers(aten.nll_loss_backward.default)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    return _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)


@lowers(aten.nll_loss2d_forward.default)
def nll_loss2d_forward(self, target, weight, reduction, ignore_index):
    return _nll_forward(self, target, weight, reduction, ignore_index)


@lowers(aten.nll_loss2d_backward.default)
def nll_loss2d_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    return _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)


@lowers(aten.mse_loss.default)
def mse_loss(self, target, reduction=_REDUCTION_MEAN):
    diff = _up(self) - _up(target)
    return _reduce(diff * diff, reduction)


@lowers(aten.mse_loss_backward.default)
def mse_loss_backward(grad_output, self, target, reduction):
    grad = 2 * (_up(self) - _up(target)) * _up(grad_output)
    return _mean_scale(grad, reduction, self.size)


@lowers(aten.binary_cross_entropy.default)
def binary_cross_entropy(self, target, weight=None, reduction=_REDUCTION_MEAN):
    x, t = _up(self), _up(target)
    # torch clamps each log term at -100 so that x = 0 or 1 gives a finite loss.
    log_x = jnp.maximum(jnp.log(x), -100)
    log_1mx = jnp.maximum(jnp.log1p(-x), -100)
    loss = -(t * log_x + (1 - t) * log_1mx)
    if weight is not None:
        loss = loss * _up(weight)
    return _reduce(loss, reduction)


@lowers(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=_REDUCTION_MEAN):
    x, t = _up(self), _up(target)
    grad = _up(grad_output) * (x - t) / jnp.maximum((1 - x) * x, 1e-12)
    if weight is not None:
        grad = grad * _up(weight)
    return _mean_scale(grad, reduction, self.size)


@lowers(aten.smooth_l1_loss.default)
def smooth_l1_loss(self, target, reduction=_REDUCTION_MEAN, beta=1.0):
    diff = jnp.abs(_up(self) - _up(target))
    # beta may be traced: select rather than branch; beta == 0 selects the L1 side everywhere.
    loss = jnp.where(diff < beta, 0.5 * diff * diff / jnp.where(beta == 0, 1, beta), diff - 0.5 * beta)
    return _reduce(loss, reduction)


@lowers(aten.smooth_l1_loss_backward.default)
def smooth_l1_loss_backward(grad_output, self, target, reduction, beta):
    diff = _up(self) - _up(target)
    # Same comparison order as torch: with beta == 0 a zero difference takes the -1 side.
    inner = diff / jnp.where(beta == 0, 1, beta)
    slope = jnp.where(diff <= -beta, -1.0, jnp.where(diff >= beta, 1.0, inner))
    return _mean_scale(slope * _up(grad_output), reduction, self.size)


@lowers(aten.huber_loss.default)
def huber_loss(self, target, reduction=_REDUCTION_MEAN, delta=1.0):
    diff = jnp.abs(_up(self) - _up(target))
    loss = jnp.where(diff < delta, 0.5 * diff * diff, delta * (diff - 0.5 * delta))
    return _reduce(loss, reduction)


@lowers(aten.huber_loss_backward.default)
def huber_loss_backward(grad_output, self, target, reduction, delta):
    diff = _up(self) - _up(target)
    slope = jnp.clip(diff, -delta, delta)
    return _mean_scale(slope * _up(grad_output), reduction, self.size)
