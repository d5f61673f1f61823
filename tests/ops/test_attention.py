"""Fused attention lowering against PyTorch's SDPA (math path and autograd) on CPU."""

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F

from tests.ops.lowering_check import to_jax, to_torch
from tests.tolerances import elementwise_rtol, rtol_for
from tpu_train.ops import attention


def tolerance(dtype, n, depth, roundings, scale):
    """assert_close's (atol, rtol) for attention in ``dtype`` (tests/tolerances.py): ``depth``
    chained reductions of length at most ``n`` (the forward: scores = q k^T over head_dim, the
    softmax's sum over the keys, P v over the keys; the backward adds dO v^T over head_dim,
    rowsum(dO * O), dS k over the keys and dS^T q / P^T dO over the queries), in float32:
    rtol_for(float32, n, depth), with the softmax's exp / log ("default" accuracy); a 16-bit
    dtype rounds ``roundings`` intermediates (scores, probabilities, output, ...) to the
    dtype (elementwise_rtol). Outputs that cancel to near zero (a weighted sum of values,
    gradients) get atol = rtol at ``scale``, the size of the tensor's largest elements."""
    rtol = rtol_for(torch.float32, n, depth) + elementwise_rtol(dtype, "default", roundings)
    return dict(atol=rtol * scale, rtol=rtol)


def largest(t):
    return float(t.detach().float().abs().max())


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + sum(shape))
    return torch.randn(*shape, generator=g).to(dtype)


def make_mask(kind, b, h, sq, sk):
    if kind is None:
        return None
    if kind == "additive":
        return rand(b, h, sq, sk, seed=7)
    if kind == "additive_broadcast":
        return rand(1, 1, sq, sk, seed=8)
    keep = torch.rand(b, 1, sq, sk, generator=torch.Generator().manual_seed(3)) > 0.3
    keep[..., 0] = True  # every query sees at least one key
    return keep


def run_forward(q, k, v, mask, is_causal, scale, dropout_p=0.0, key=None):
    return attention.scaled_dot_product_fused_attention(
        to_jax(q), to_jax(k), to_jax(v), to_jax(mask) if mask is not None else None, dropout_p, is_causal,
        False, scale=scale, rng_key=key if key is not None else jax.random.key(0))


def reference_logsumexp(q, k, mask, is_causal, scale):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).float()
    scores = q.float() @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores + (torch.where(mask, 0.0, float("-inf")) if mask.dtype == torch.bool else mask)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.logsumexp(scores, -1)


CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, Dv, mask, is_causal, scale)
    (2, 4, 4, 5, 5, 8, 8, None, False, None),
    (2, 4, 4, 5, 5, 8, 8, None, True, None),
    (1, 4, 2, 6, 6, 8, 8, None, True, None),       # GQA
    (2, 6, 2, 4, 7, 8, 5, "additive", False, 0.3),  # GQA, cross lengths, Dv != D, custom scale
    (2, 2, 1, 5, 5, 4, 4, "additive_broadcast", False, None),
    (2, 4, 2, 5, 6, 8, 8, "bool", False, None),
    (1, 2, 2, 6, 4, 8, 8, None, True, 1.0),         # causal with Sq > Sk
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_match_torch(case, dtype):
    b, hq, hkv, sq, sk, d, dv, mask_kind, is_causal, scale = case
    q, k, v = rand(b, hq, sq, d, dtype=dtype), rand(b, hkv, sk, d, dtype=dtype, seed=1), \
        rand(b, hkv, sk, dv, dtype=dtype, seed=2)
    mask = make_mask(mask_kind, b, hq, sq, sk)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    mask_leaf = mask.detach().requires_grad_() if mask is not None and mask.is_floating_point() else mask
    expected = F.scaled_dot_product_attention(*leaves, attn_mask=mask_leaf, is_causal=is_causal, scale=scale,
                                              enable_gqa=hkv != hq)
    grad = rand(*expected.shape, dtype=dtype, seed=5)
    expected.backward(grad)

    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, debug = run_forward(q, k, v, mask, is_causal, scale)
    assert (max_q, max_k) == (sq, sk) and cum_q is None and cum_k is None and debug is None
    assert lse.shape == (b, hq, sq) and seed.shape == () and offset.shape == ()
    # Forward: q k^T (head_dim), softmax (keys), P v (keys); bf16 rounds scores, P and out.
    n = max(d, dv, sq, sk)
    forward = dict(dtype=dtype, n=n, depth=3, roundings=3)
    torch.testing.assert_close(to_torch(out, dtype), expected.detach(),
                               **tolerance(**forward, scale=largest(expected)))
    # The log-sum-exp (float32 on both sides): q k^T and the sum over the keys; bf16 rounds the scores.
    reference_lse = reference_logsumexp(q, k, mask, is_causal, scale)
    finite = reference_lse.isfinite()
    torch.testing.assert_close(to_torch(lse, torch.float32), reference_lse,
                               **tolerance(dtype, n, 2, 1, largest(reference_lse[finite])))

    wants_bias_grad = mask_leaf is not None and mask_leaf.requires_grad
    grads = attention.scaled_dot_product_fused_attention_backward(
        to_jax(grad), to_jax(q), to_jax(k), to_jax(v), to_jax(mask) if mask is not None else None,
        [True, True, True, wants_bias_grad], out, lse, None, None, max_q, max_k, 0.0, is_causal, seed, offset,
        scale=scale)
    # Backward: the forward's chain, then dO v^T (head_dim), rowsum(dO * O), dS k (keys),
    # dS^T q and P^T dO (queries); bf16 rounds P, dP, dS and the gradient as well.
    backward = dict(dtype=dtype, n=n, depth=6, roundings=6)
    for got, leaf in zip(grads[:3], leaves):
        assert got.shape == leaf.shape
        torch.testing.assert_close(to_torch(got, dtype), leaf.grad,
                                   **tolerance(**backward, scale=largest(leaf.grad)))
    if wants_bias_grad:
        assert grads[3].shape == mask.shape
        torch.testing.assert_close(to_torch(grads[3], dtype), mask_leaf.grad,
                                   **tolerance(**backward, scale=largest(mask_leaf.grad)))
    else:
        assert grads[3] is None


def test_fully_masked_rows_give_zero_output_and_gradient():
    q, k, v = rand(1, 2, 3, 4), rand(1, 2, 5, 4, seed=1), rand(1, 2, 5, 4, seed=2)
    keep = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    keep[..., 1, :] = False
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    out, lse, *_ , seed, offset, _ = run_forward(q, k, v, keep, False, None)
    torch.testing.assert_close(to_torch(out, torch.float32), expected)
    assert bool(jnp.all(jnp.isneginf(lse[..., 1])))
    grads = attention.scaled_dot_product_fused_attention_backward(
        to_jax(torch.ones(1, 2, 3, 4)), to_jax(q), to_jax(k), to_jax(v), to_jax(keep), [True, True, True, False],
        out, lse, None, None, 3, 5, 0.0, False, seed, offset)
    assert bool(jnp.all(jnp.isfinite(grads[0]))) and bool(jnp.all(grads[0][:, :, 1] == 0))


def test_only_masked_gradients_are_returned():
    q, k, v = rand(1, 2, 3, 4), rand(1, 2, 3, 4, seed=1), rand(1, 2, 3, 4, seed=2)
    out, lse, *_, seed, offset, _ = run_forward(q, k, v, None, True, None)
    grads = attention.scaled_dot_product_fused_attention_backward(
        to_jax(torch.ones(1, 2, 3, 4)), to_jax(q), to_jax(k), to_jax(v), None, [False, True, False, False],
        out, lse, None, None, 3, 3, 0.0, True, seed, offset)
    assert grads[0] is None and grads[2] is None and grads[3] is None and grads[1].shape == (1, 2, 3, 4)


def test_dropout_backward_is_the_vjp_of_the_same_forward():
    """With dropout there is no CPU oracle with the same mask: the backward must reproduce the
    forward's mask from the returned seed, i.e. equal the VJP of the forward at that key."""
    q, k, v = (to_jax(rand(1, 4, 5, 8, seed=s)) for s in range(3))
    k, v = k[:, :2], v[:, :2]
    key = jax.random.key(42)
    p = 0.4

    def forward(q, k, v):
        return attention.scaled_dot_product_fused_attention(q, k, v, None, p, True, False, rng_key=key)[0]

    out, pullback = jax.vjp(forward, q, k, v)
    full = attention.scaled_dot_product_fused_attention(q, k, v, None, p, True, False, rng_key=key)
    no_dropout = attention.scaled_dot_product_fused_attention(q, k, v, None, 0.0, True, False, rng_key=key)[0]
    assert not bool(jnp.allclose(out, no_dropout))
    g = jnp.ones_like(out)
    expected = pullback(g)
    got = attention.scaled_dot_product_fused_attention_backward(
        g, q, k, v, None, [True, True, True, False], full[0], full[1], None, None, 5, 5, p, True, full[6], full[7])
    for e, a in zip(expected, got[:3]):
        # Two float32 backward passes (head_dim 8, 5 keys and queries; see tolerance()).
        tol = tolerance(torch.float32, 8, 6, 0, float(jnp.abs(e).max()))
        assert bool(jnp.allclose(e, a, **tol))


@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[5]], ids=["gqa_causal", "gqa_additive", "bool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jax_derivative_of_the_forward_is_the_fused_backward(case, dtype):
    """A compiled step's loss graph lets JAX differentiate the forward lowering: its custom
    derivative (``attention.attention``) must give PyTorch's gradients, in the inputs' dtype."""
    b, hq, hkv, sq, sk, d, dv, mask_kind, is_causal, scale = case
    q, k, v = rand(b, hq, sq, d, dtype=dtype), rand(b, hkv, sk, d, dtype=dtype, seed=1), \
        rand(b, hkv, sk, dv, dtype=dtype, seed=2)
    mask = make_mask(mask_kind, b, hq, sq, sk)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=hkv != hq)
    grad = rand(*expected.shape, dtype=dtype, seed=5)
    expected.backward(grad)
    jax_mask = to_jax(mask) if mask is not None else None

    def loss(q_, k_, v_):
        out = run_forward_arrays(q_, k_, v_, jax_mask, is_causal, scale)
        return jnp.sum(out.astype(jnp.float32) * to_jax(grad).astype(jnp.float32))

    grads = jax.grad(loss, argnums=(0, 1, 2))(to_jax(q), to_jax(k), to_jax(v))
    backward = dict(dtype=dtype, n=max(d, dv, sq, sk), depth=6, roundings=6)
    for got, leaf in zip(grads, leaves):
        assert got.dtype == to_jax(leaf.detach()).dtype
        torch.testing.assert_close(to_torch(got, dtype), leaf.grad,
                                   **tolerance(**backward, scale=largest(leaf.grad)))


def run_forward_arrays(q, k, v, mask, is_causal, scale):
    return attention.scaled_dot_product_fused_attention(q, k, v, mask, 0.0, is_causal, False,
                                                        scale=scale)[0]
