"""Softmax, normalisation, embedding and loss lowerings against PyTorch on CPU."""

import jax.numpy as jnp
import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches, run_lowering, to_jax, to_torch
from tests.tolerances import elementwise_rtol, rtol_for
from tpu_train.ops import nn as _registers_nn_lowerings  # noqa: F401
from tpu_train.ops import registry

aten = torch.ops.aten

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def tolerance(dtype, n, scale=1.0, roundings=1, cond=1.0):
    """assert_close's (atol, rtol) for an op in ``dtype`` whose longest reduction has length
    ``n`` (softmax: the softmax dim; a norm: the normalised elements, or the rows summed for a
    weight gradient; a loss: the elements summed) with a few elementwise functions around it
    (exp, log, rsqrt: the "default" accuracy) (tests/tolerances.py): rtol_for(float32, n) +
    elementwise_rtol(dtype, "default", roundings), the 16-bit dtypes being computed in float32
    and rounded to the dtype ``roundings`` times. Outputs that cancel to near zero need an
    atol: rtol at ``scale``, the size of the values the output is computed from. ``cond``
    multiplies both by a condition number where a cancellation amplifies the rounding (a
    normalisation of x: x - mean is off by u |x|, scaled by rstd, so max|x| * rstd); it
    amplifies the float32 computation's rounding, not the final rounding to a 16-bit dtype."""
    compute = rtol_for(torch.float32, n) + elementwise_rtol(torch.float32, "default")
    output_rounding = (elementwise_rtol(dtype, "default", roundings)
                       - elementwise_rtol(torch.float32, "default"))
    rtol = cond * compute + output_rounding
    return dict(atol=rtol * scale, rtol=rtol)


def largest(*outputs):
    """The largest |value| among an op's outputs (None skipped): the size of the terms an
    output element is summed from, for the atol of elements that cancel to near zero."""
    return max(float(o.detach().float().abs().max()) for o in outputs if o is not None and o.numel())


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + sum(shape) + len(shape))
    return torch.randn(*shape, generator=g).to(dtype)


def assert_masked_outputs(op, args, output_mask, **tol):
    """Compare a backward op whose ``output_mask`` switches some outputs off (torch: None)."""
    expected = op(*args)
    got = registry.get_lowering(op).fn(*[to_jax(a) for a in args])
    assert len(got) == len(expected)
    for g, e, wanted in zip(got, expected, output_mask):
        if not wanted:
            assert g is None and e is None
            continue
        assert g.shape == e.shape
        torch.testing.assert_close(to_torch(g, e.dtype), e, **tol)


# --- softmax ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dim", [0, -1, 1])
def test_softmax_and_log_softmax(dtype, dim):
    x = rand(3, 5, 7, dtype=dtype) * 4
    # A sum of exp over the softmax dim; log_softmax is x - max - log(sum), which cancels
    # near zero: atol at the size of x - max (up to 2 max|x|).
    tol = tolerance(dtype, x.shape[dim], scale=2 * float(x.abs().max()))
    assert_lowering_matches(aten._softmax.default, x, dim, False, **tol)
    assert_lowering_matches(aten._log_softmax.default, x, dim, False, **tol)


def test_softmax_half_to_float_and_extreme_values():
    x = torch.tensor([[1e4, -1e4, 0.0], [float("-inf"), 0.0, 1.0]])
    assert_lowering_matches(aten._softmax.default, x, 1, False)
    assert_lowering_matches(aten._log_softmax.default, x, 1, False)


def test_softmax_half_to_float_returns_float32():
    # CPU torch rejects half_to_float, so compare with the float32 softmax of the same values.
    x = rand(4, 6).half()
    got = registry.get_lowering(aten._softmax.default).fn(to_jax(x), 1, True)
    assert got.dtype == jnp.float32
    torch.testing.assert_close(to_torch(got, torch.float32), torch.softmax(x.float(), 1))


def test_safe_softmax_zeroes_fully_masked_rows():
    x = rand(3, 4)
    x[1] = float("-inf")
    x[2, :2] = float("-inf")
    assert_lowering_matches(aten._safe_softmax.default, x, -1)
    # A sum of exp over the 4 keys, output in [0, 1].
    assert_lowering_matches(aten._safe_softmax.default, x.bfloat16(), -1, **tolerance(torch.bfloat16, 4))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("dim", [0, -1])
def test_softmax_backward(dtype, dim):
    x = rand(4, 6, dtype=dtype)
    grad = rand(4, 6, dtype=dtype, seed=1)
    out = torch.softmax(x, dim)
    log_out = torch.log_softmax(x, dim)
    # out * (grad - sum(grad * out)) and grad - exp(out) * sum(grad) over the softmax dim: the
    # sum of grad (|grad| up to ~3) cancels against grad, atol at the sum's size.
    n = x.shape[dim]
    tol = tolerance(dtype, n, scale=float(grad.abs().max()) * n ** 0.5)
    assert_lowering_matches(aten._softmax_backward_data.default, grad, out, dim, dtype, **tol)
    assert_lowering_matches(aten._log_softmax_backward_data.default, grad, log_out, dim, dtype, **tol)


@pytest.mark.parametrize("op, backward", [
    (aten._softmax.default, aten._softmax_backward_data.default),
    (aten._log_softmax.default, aten._log_softmax_backward_data.default),
    (aten._safe_softmax.default, aten._softmax_backward_data.default)])
def test_jax_derivative_of_softmax_is_torchs_backward(op, backward):
    # The compiled step takes JAX's derivative of the forward lowerings: it is PyTorch's
    # backward formula (the backward lowering's values, bit for bit) and carries nothing
    # through the row max (no equality mask of each row's maximum in the program).
    import jax

    x, grad = to_jax(rand(4, 6) * 4), to_jax(rand(4, 6, seed=1))
    if op == aten._safe_softmax.default:
        x = x.at[1].set(-jnp.inf).at[2, :3].set(-jnp.inf)
    forward = registry.get_lowering(op).fn
    args = (-1,) if op == aten._safe_softmax.default else (-1, False)
    out, pullback = jax.vjp(lambda v: forward(v, *args), x)
    expected = registry.get_lowering(backward).fn(grad, out, -1, jnp.float32)
    assert jnp.array_equal(pullback(grad)[0], expected)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda v: forward(v, *args).sum()))(x))
    assert "reduce_max" in jaxpr and "bool[4,6] = eq" not in jaxpr


# --- layer / RMS / group norm ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("normalized_shape", [[8], [3, 8]])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_forward_and_backward(dtype, normalized_shape, affine):
    x = rand(2, 3, 8, dtype=dtype) * 3 + 1
    w = rand(*normalized_shape, dtype=dtype, seed=2) if affine else None
    b = rand(*normalized_shape, dtype=dtype, seed=3) if affine else None
    # Mean and variance over the normalised elements, the weight / bias gradients over the
    # rows (2 x 3 / len(normalized_shape[0]): fewer); atol at the outputs' size.
    n = 8 * len(normalized_shape)
    out = aten.native_layer_norm(x, normalized_shape, w, b, 1e-5)
    assert_lowering_matches(aten.native_layer_norm.default, x, normalized_shape, w, b, 1e-5,
                            **tolerance(dtype, n, scale=largest(*out)))
    _, mean, rstd = out
    grad = rand(2, 3, 8, dtype=dtype, seed=4)
    mask = [True, affine, affine]
    args = (grad, x, normalized_shape, mean, rstd, w, b, mask)
    tol = tolerance(dtype, n, scale=largest(*aten.native_layer_norm_backward(*args)))
    assert_masked_outputs(aten.native_layer_norm_backward.default, args, mask, **tol)


def test_layer_norm_backward_respects_output_mask():
    x, w, b = rand(4, 6), rand(6, seed=1), rand(6, seed=2)
    _, mean, rstd = aten.native_layer_norm(x, [6], w, b, 1e-5)
    mask = [False, True, False]
    assert_masked_outputs(aten.native_layer_norm_backward.default,
                          (rand(4, 6, seed=3), x, [6], mean, rstd, w, b, mask), mask)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("eps", [None, 1e-6])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_forward_and_backward(dtype, eps, with_weight):
    x = rand(2, 5, 16, dtype=dtype)
    w = rand(16, dtype=dtype, seed=1) if with_weight else None
    # Mean of squares over the 16 normalised elements (the weight gradient: over 2 x 5 rows);
    # atol at the outputs' size.
    out = aten._fused_rms_norm(x, [16], w, eps)
    assert_lowering_matches(aten._fused_rms_norm.default, x, [16], w, eps,
                            **tolerance(dtype, 16, scale=largest(*out)))
    # CPU torch has no kernel for the backward op: autograd of the forward is the oracle.
    x_leaf = x.detach().requires_grad_()
    w_leaf = w.detach().requires_grad_() if with_weight else None
    out, rstd = aten._fused_rms_norm(x_leaf, [16], w_leaf, eps)
    grad = rand(2, 5, 16, dtype=dtype, seed=2)
    out.backward(grad)
    got_input, got_weight = registry.get_lowering(aten._fused_rms_norm_backward.default).fn(
        to_jax(grad), to_jax(x), [16], to_jax(rstd.detach()), to_jax(w), [True, with_weight])
    tol = tolerance(dtype, 16, scale=largest(x_leaf.grad, w_leaf.grad if with_weight else None))
    torch.testing.assert_close(to_torch(got_input, dtype), x_leaf.grad, **tol)
    if with_weight:
        torch.testing.assert_close(to_torch(got_weight, dtype), w_leaf.grad, **tol)
    else:
        assert got_weight is None


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,groups", [((2, 6, 4, 4), 3), ((3, 4, 5), 2), ((2, 8), 4)])
def test_group_norm_forward_and_backward(dtype, shape, groups):
    x = rand(*shape, dtype=dtype) * 2 + 0.5
    n, c = shape[:2]
    hxw = x.numel() // (n * c)
    w, b = rand(c, dtype=dtype, seed=1), rand(c, dtype=dtype, seed=2)
    # Mean and variance over a group (c / groups x hxw elements), the weight / bias gradients
    # over n x hxw; atol at the outputs' size. A tiny group (2 elements) has a small variance,
    # hence a large rstd that amplifies the rounding of x - mean: condition max|x| * rstd.
    length = max(c // groups * hxw, n * hxw)
    out = aten.native_group_norm(x, w, b, n, c, hxw, groups, 1e-5)
    _, mean, rstd = out
    cond = max(1.0, float(x.float().abs().max() * rstd.float().max()))
    assert_lowering_matches(aten.native_group_norm.default, x, w, b, n, c, hxw, groups, 1e-5,
                            **tolerance(dtype, length, scale=largest(*out), cond=cond))
    grad = rand(*shape, dtype=dtype, seed=3)
    args = (grad, x, mean, rstd, w, n, c, hxw, groups, [True, True, True])
    tol = tolerance(dtype, length, scale=largest(*aten.native_group_norm_backward(*args)), cond=cond)
    assert_lowering_matches(aten.native_group_norm_backward.default, *args, **tol)
    assert_masked_outputs(aten.native_group_norm_backward.default,
                          (grad, x, mean, rstd, None, n, c, hxw, groups, [True, False, False]),
                          [True, False, False], **tol)


# --- batch norm ------------------------------------------------------------------------------


def batch_norm_args(shape, dtype=torch.float32):
    c = shape[1]
    return (rand(*shape, dtype=dtype) * 2 + 1, rand(c, seed=1), rand(c, seed=2),
            rand(c, seed=3), torch.rand(c) + 0.5)


@pytest.mark.parametrize("shape", [(4, 3, 5), (2, 3, 4, 4), (6, 3)])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_functional_returns_updated_stats(shape, training):
    x, w, b, rm, rv = batch_norm_args(shape)
    assert_lowering_matches(aten._native_batch_norm_legit_functional.default, x, w, b, rm, rv,
                            training, 0.1, 1e-5)


def test_batch_norm_functional_matches_the_mutating_op():
    x, w, b, rm, rv = batch_norm_args((4, 3, 5))
    rm_ref, rv_ref = rm.clone(), rv.clone()
    expected = aten._native_batch_norm_legit(x, w, b, rm_ref, rv_ref, True, 0.3, 1e-5)
    got, _ = run_lowering(aten._native_batch_norm_legit_functional.default, x, w, b, rm, rv, True, 0.3, 1e-5)
    for g, e in zip(got, list(expected) + [rm_ref, rv_ref]):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("dtype", FLOATS)
def test_batch_norm_no_stats_and_no_training(dtype):
    x, w, b, rm, rv = batch_norm_args((4, 3, 5), dtype)
    # Mean and variance per channel over 4 x 5; atol at the outputs' size.
    out = aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)
    tol = tolerance(dtype, 4 * 5, scale=largest(*out))
    assert_lowering_matches(aten._native_batch_norm_legit.no_stats, x, w, b, True, 0.1, 1e-5, **tol)
    assert_lowering_matches(aten._native_batch_norm_legit.no_stats, x, None, None, True, 0.1, 1e-5, **tol)
    assert_lowering_matches(aten._native_batch_norm_legit_no_training.default, x, w, b, rm, rv, 0.1, 1e-5,
                            **tol)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("shape", [(4, 3, 5), (2, 3, 4, 4)])
def test_batch_norm_backward(train, shape):
    x, w, b, rm, rv = batch_norm_args(shape)
    _, save_mean, save_invstd = aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)
    grad = rand(*shape, seed=7)
    # Sums of grad and grad * x_hat per channel over batch x spatial; atol at the outputs' size.
    args = (grad, x, w, rm, rv, save_mean, save_invstd, train, 1e-5, [True, True, True])
    tol = tolerance(torch.float32, x.numel() // x.shape[1],
                    scale=largest(*aten.native_batch_norm_backward(*args)))
    assert_lowering_matches(aten.native_batch_norm_backward.default, *args, **tol)
    assert_masked_outputs(aten.native_batch_norm_backward.default,
                          (grad, x, None, rm, rv, save_mean, save_invstd, train, 1e-5, [True, False, True]),
                          [True, False, True], **tol)


# --- embedding -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_embedding(dtype):
    weight = rand(10, 4, dtype=dtype)
    indices = torch.tensor([[0, 3, 9], [3, 3, 1]])
    assert_lowering_matches(aten.embedding.default, weight, indices, atol=0, rtol=0)


@pytest.mark.parametrize("padding_idx", [-1, 3])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_dense_backward(padding_idx, scale_grad_by_freq, dtype):
    indices = torch.tensor([[0, 3, 9], [3, 3, 1]])
    grad = rand(2, 3, 4, dtype=dtype)
    # A row's gradient sums the (up to 3) gradients of the positions that look it up, then
    # one division (scale_grad_by_freq); atol at their sum's size.
    assert_lowering_matches(aten.embedding_dense_backward.default, grad, indices, 10, padding_idx,
                            scale_grad_by_freq, **tolerance(dtype, 3, scale=3 * largest(grad)))


# --- losses ----------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_nll_loss(reduction, with_weight, ignore_index):
    logp = torch.log_softmax(rand(6, 5), 1)
    target = torch.tensor([0, 2, 4, -100, 2, 1]) if ignore_index == -100 else torch.tensor([0, 2, 4, 1, 2, 1])
    weight = torch.rand(5) + 0.1 if with_weight else None
    out, total = aten.nll_loss_forward(logp, target, weight, reduction, ignore_index)
    assert_lowering_matches(aten.nll_loss_forward.default, logp, target, weight, reduction, ignore_index)
    grad = rand(6, seed=4) if reduction == 0 else torch.tensor(0.7)
    assert_lowering_matches(aten.nll_loss_backward.default, grad, logp, target, weight, reduction,
                            ignore_index, total)


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_nll_loss_single_sample(reduction):
    logp = torch.log_softmax(rand(5), 0)
    weight = torch.rand(5) + 0.1
    for target in (torch.tensor(3), torch.tensor(-100)):
        out, total = aten.nll_loss_forward(logp, target, weight, reduction, -100)
        assert_lowering_matches(aten.nll_loss_forward.default, logp, target, weight, reduction, -100)
        assert_lowering_matches(aten.nll_loss_backward.default, torch.tensor(1.5), logp, target, weight,
                                reduction, -100, total)


def test_nll_loss_all_ignored_mean_is_nan():
    logp = torch.log_softmax(rand(3, 4), 1)
    target = torch.full((3,), -100)
    assert_lowering_matches(aten.nll_loss_forward.default, logp, target, None, 1, -100)


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("with_weight", [False, True])
def test_nll_loss2d(reduction, with_weight):
    logp = torch.log_softmax(rand(2, 4, 3, 5), 1)
    target = torch.randint(0, 4, (2, 3, 5), generator=torch.Generator().manual_seed(0))
    target[0, 1, 2] = -100
    weight = torch.rand(4) + 0.1 if with_weight else None
    _, total = aten.nll_loss2d_forward(logp, target, weight, reduction, -100)
    assert_lowering_matches(aten.nll_loss2d_forward.default, logp, target, weight, reduction, -100)
    grad = rand(2, 3, 5, seed=3) if reduction == 0 else torch.tensor(0.3)
    assert_lowering_matches(aten.nll_loss2d_backward.default, grad, logp, target, weight, reduction, -100,
                            total)


def loss_grad(reduction, shape):
    return rand(*shape, seed=9) if reduction == 0 else torch.tensor(1.3)


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("dtype", FLOATS)
def test_mse_loss(reduction, dtype):
    x, t = rand(3, 4, dtype=dtype), rand(3, 4, dtype=dtype, seed=1)
    # (x - t)^2 summed over the 12 elements (x - t cancels: atol at the inputs' size).
    tol = tolerance(dtype, 12, scale=largest(x, t))
    assert_lowering_matches(aten.mse_loss.default, x, t, reduction, **tol)
    assert_lowering_matches(aten.mse_loss_backward.default, loss_grad(reduction, (3, 4)).to(dtype), x, t,
                            reduction, **tol)


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("with_weight", [False, True])
def test_binary_cross_entropy(reduction, with_weight):
    x = torch.tensor([[0.0, 0.3, 1.0], [0.5, 0.9, 1e-4]])
    t = torch.tensor([[0.0, 1.0, 1.0], [0.2, 0.0, 1.0]])
    w = torch.rand(2, 3) if with_weight else None
    assert_lowering_matches(aten.binary_cross_entropy.default, x, t, w, reduction)
    # Away from 0 and 1, where the gradient is finite.
    xs = torch.sigmoid(rand(2, 3))
    # Elementwise g * (x - t) / (x * (1 - x)) * w, no reduction (the mean only divides);
    # x - t cancels: atol at the outputs' size.
    args = (loss_grad(reduction, (2, 3)), xs, t, w, reduction)
    tol = tolerance(torch.float32, 1, scale=largest(aten.binary_cross_entropy_backward(*args)))
    assert_lowering_matches(aten.binary_cross_entropy_backward.default, *args, **tol)


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("beta", [1.0, 0.5, 0.0])
def test_smooth_l1_loss(reduction, beta):
    x = torch.tensor([0.0, 0.2, -0.3, 2.0, -4.0, 0.5, 1.0])
    t = torch.zeros(7)
    assert_lowering_matches(aten.smooth_l1_loss.default, x, t, reduction, beta)
    assert_lowering_matches(aten.smooth_l1_loss_backward.default, loss_grad(reduction, (7,)), x, t,
                            reduction, beta)


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("delta", [1.0, 0.5])
def test_huber_loss(reduction, delta):
    x = torch.tensor([0.0, 0.2, -0.3, 2.0, -4.0, 0.5, 1.0])
    t = torch.zeros(7)
    assert_lowering_matches(aten.huber_loss.default, x, t, reduction, delta)
    assert_lowering_matches(aten.huber_loss_backward.default, loss_grad(reduction, (7,)), x, t, reduction,
                            delta)
