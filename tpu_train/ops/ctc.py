"""``_ctc_loss`` (connectionist temporal classification) and its backward.

The forward variable ``α_t(s)`` over the blank-extended target ``l'`` (``2·S + 1`` labels,
blanks at even positions) runs in log space as one ``lax.scan`` over time, for the whole
batch: ``α_t(s) = logsumexp(α_{t-1}(s), α_{t-1}(s-1), α_{t-1}(s-2)) + log_probs[t, l'_s]``, the
``s - 2`` term only for a non-blank label that differs from ``l'_{s-2}``. Each sequence stops
at its input length; its loss is ``-logsumexp`` of the last two ``α`` of its extended target
(just the last for an empty target). Targets come padded ``(N, S)`` or concatenated 1-d.

Outputs follow ATen: ``neg_log_likelihood`` ``(N,)`` and ``log_alpha`` ``(N, T, 2·max S +
1)`` (entries outside a sequence's lengths are -inf; ATen leaves them unset). With
``zero_infinity`` the backward gives 0 for a sequence of infinite loss (no valid alignment).
The backward is ATen's: ``exp(log_probs) - exp(log α + log β - log_probs - nll)`` times the
incoming gradient for ``t`` before the input length (the gradient through a ``log_softmax``
that produced ``log_probs``), obtained from the pullback of this forward plus the
``exp(log_probs)`` term; 0 past the input length. The ``.Tensor`` overloads read the lengths
on the host (eager only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpu_train.ops.conversion import opmath_dtype
from tpu_train.ops.registry import aten, lowers

_LOG_ZERO = -1e30


def _padded_targets(targets, target_lengths, batch):
    """``(N, max S)`` targets from the padded or the concatenated layout."""
    longest = max(target_lengths) if len(target_lengths) else 0
    if targets.ndim == 2:
        return targets[:, :longest]
    starts = np.concatenate([[0], np.cumsum(target_lengths)[:-1]]).astype(np.int32)
    index = np.minimum(starts[:, None] + np.arange(longest)[None, :],
                       max(targets.shape[0] - 1, 0))
    return targets[index] if targets.shape[0] else jnp.zeros((batch, longest), jnp.int32)


def _ctc(log_probs, targets, input_lengths, target_lengths, blank):
    """``(nll (N,), log_alpha (N, T, 2·max S + 1))`` in the compute dtype."""
    t_max, batch, _ = log_probs.shape
    labels = _padded_targets(targets, list(target_lengths), batch).astype(jnp.int32)
    width = 2 * labels.shape[1] + 1
    ext = jnp.full((batch, width), blank, jnp.int32).at[:, 1::2].set(labels)
    lengths = jnp.asarray(np.asarray(target_lengths, np.int32))
    steps = jnp.asarray(np.asarray(input_lengths, np.int32))
    s = jnp.arange(width)
    valid = s[None, :] < (2 * lengths[:, None] + 1)
    previous = jnp.concatenate([jnp.full((batch, 2), -1, jnp.int32), ext[:, :-2]], axis=1)
    skip = (ext != blank) & (ext != previous) & (s[None, :] >= 2)
    # A finite stand-in for log 0: its gradients stay finite (they vanish through exp) where
    # those of logaddexp(-inf, -inf) would be NaN; mapped back to -inf in the outputs.
    neg_inf = jnp.asarray(_LOG_ZERO, log_probs.dtype)

    def emit(t):
        return jnp.maximum(jnp.take_along_axis(log_probs[t], ext, axis=1), neg_inf)

    alpha0 = jnp.where((s[None, :] < 2) & valid, emit(0), neg_inf)

    def step(alpha, t):
        one = jnp.concatenate([jnp.full((batch, 1), neg_inf), alpha[:, :-1]], axis=1)
        two = jnp.concatenate([jnp.full((batch, 2), neg_inf), alpha[:, :-2]], axis=1)
        two = jnp.where(skip, two, neg_inf)
        new = jnp.logaddexp(jnp.logaddexp(alpha, one), two) + emit(t)
        new = jnp.where(valid & (t < steps)[:, None], new, alpha)
        return new, new

    last, history = lax.scan(step, alpha0, jnp.arange(1, t_max))
    log_alpha = jnp.concatenate([alpha0[None], history], axis=0).transpose(1, 0, 2)
    end = 2 * lengths
    final = jnp.take_along_axis(last, end[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(last, jnp.maximum(end - 1, 0)[:, None], axis=1)[:, 0]
    total = jnp.where(lengths > 0, jnp.logaddexp(final, before), final)
    total = jnp.where(total <= _LOG_ZERO / 2, -jnp.inf, total)
    # Past its input length a sequence's α stays -inf in ATen's table.
    running = jnp.arange(t_max)[None, :, None] < steps[:, None, None]
    log_alpha = jnp.where(running & (log_alpha > _LOG_ZERO / 2), log_alpha, -jnp.inf)
    return -total, log_alpha


@lowers(aten._ctc_loss.default)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """Returns ``(neg_log_likelihood, log_alpha)``; an infinite loss stays infinite here (the
    ``ctc_loss`` wrapper applies ``zero_infinity``)."""
    compute = opmath_dtype(log_probs.dtype)
    nll, log_alpha = _ctc(log_probs.astype(compute), targets, input_lengths, target_lengths,
                          blank)
    return nll.astype(log_probs.dtype), log_alpha.astype(log_probs.dtype)


@lowers(aten._ctc_loss.Tensor)
def ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0,
                    zero_infinity=False):
    """The lengths as tensors (read on the host)."""
    return ctc_loss(log_probs, targets, np.asarray(input_lengths).tolist(),
                    np.asarray(target_lengths).tolist(), blank, zero_infinity)


@lowers(aten._ctc_loss_backward.default)
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths,
                      neg_log_likelihood, log_alpha, blank, zero_infinity=False):
    """The gradient with respect to ``log_probs`` as ATen defines it (see the module)."""
    compute = opmath_dtype(log_probs.dtype)
    lp = log_probs.astype(compute)
    nll, pullback = jax.vjp(
        lambda x: _ctc(x, targets, input_lengths, target_lengths, blank)[0], lp)
    g = grad.astype(compute)
    finite = ~jnp.isinf(nll)
    (out,) = pullback(jnp.where(finite, g, 0))
    steps = jnp.asarray(np.asarray(input_lengths, np.int32))
    before_end = (jnp.arange(lp.shape[0])[:, None] < steps[None, :])[..., None]
    out = jnp.where(before_end, out + jnp.exp(lp) * g[None, :, None], 0)
    if zero_infinity:
        out = jnp.where(finite[None, :, None], out, 0)
    return out.astype(log_probs.dtype)


@lowers(aten._ctc_loss_backward.Tensor)
def ctc_loss_backward_tensor(grad, log_probs, targets, input_lengths, target_lengths,
                             neg_log_likelihood, log_alpha, blank, zero_infinity=False):
    """The lengths as tensors (read on the host)."""
    return ctc_loss_backward(grad, log_probs, targets, np.asarray(input_lengths).tolist(),
                             np.asarray(target_lengths).tolist(), neg_log_likelihood,
                             log_alpha, blank, zero_infinity)
