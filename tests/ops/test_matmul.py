"""Matrix product and linear algebra lowerings against PyTorch on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import lax

from tests.ops.lowering_check import assert_lowering_matches, run_lowering, to_jax
from tests.tolerances import rtol_for
from tpu_train.ops import matmul

aten = torch.ops.aten

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tolerances(dtype, k, scale=1.0):
    """Elementwise (atol, rtol) for a product of unit-normal inputs with inner dimension k
    (tests/tolerances.py). float32: the k-term sum's rounding, rtol_for(float32, k); bf16 /
    fp16 accumulate in float32 and round the output once to the dtype. An element's size is
    ~sqrt(k) (times ``scale`` for alpha / beta): atol is rtol at that size, which covers the
    elements that cancel to near zero."""
    if not dtype.is_floating_point:
        return dict(atol=0, rtol=0)
    rtol = rtol_for(torch.float32, k) + (0.0 if dtype == torch.float32 else rtol_for(dtype))
    return dict(atol=rtol * max(k, 1) ** 0.5 * scale, rtol=rtol)


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + len(shape) * 7 + sum(shape))
    if dtype.is_floating_point:
        return torch.randn(*shape, generator=g).to(dtype)
    return torch.randint(-5, 6, shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES) + [torch.int32, torch.int64])
@pytest.mark.parametrize("m,k,n", [(3, 5, 4), (1, 1, 1), (17, 33, 9), (4, 0, 3)])
def test_mm(dtype, m, k, n):
    tol = tolerances(dtype, k)
    assert_lowering_matches(aten.mm.default, rand(m, k, dtype=dtype), rand(k, n, dtype=dtype, seed=1),
                            **tol)


@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
def test_bmm(dtype):
    assert_lowering_matches(aten.bmm.default, rand(3, 4, 5, dtype=dtype),
                            rand(3, 5, 6, dtype=dtype, seed=1), **tolerances(dtype, 5))


@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (0, 1), (1, 0), (2, -1.5)])
@pytest.mark.parametrize("bias_shape", [(4,), (3, 4), (1, 4), (3, 1)])
def test_addmm(dtype, beta, alpha, bias_shape):
    # inner dimension 5, plus the scaled bias (one more term)
    assert_lowering_matches(aten.addmm.default, rand(*bias_shape, dtype=dtype), rand(3, 5, dtype=dtype),
                            rand(5, 4, dtype=dtype, seed=2), beta=beta, alpha=alpha,
                            **tolerances(dtype, 5 + 1, max(1, abs(alpha), abs(beta))))


def test_addmm_zero_beta_drops_nan_input():
    bias = torch.full((2, 2), float("nan"))
    assert_lowering_matches(aten.addmm.default, bias, rand(2, 3), rand(3, 2), beta=0)


def test_addmm_traced_beta_zero_drops_nan_input():
    """A beta that arrives as a JAX scalar (a changing hyper-parameter) must behave like 0."""
    bias = torch.full((2, 2), float("nan"))
    a, b = rand(2, 3), rand(3, 2, seed=3)
    got = matmul.addmm(to_jax(bias), to_jax(a), to_jax(b), beta=jnp.float32(0), alpha=jnp.float32(2))
    torch.testing.assert_close(torch.from_numpy(np.array(got)), 2 * (a @ b))


@pytest.mark.parametrize("use_gelu", [False, True])
def test_addmm_activation(use_gelu):
    assert_lowering_matches(aten._addmm_activation.default, rand(4), rand(3, 5), rand(5, 4, seed=1),
                            beta=0.5, alpha=2, use_gelu=use_gelu)


@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (0, 1)])
def test_baddbmm(dtype, beta, alpha):
    assert_lowering_matches(aten.baddbmm.default, rand(1, 4, 6, dtype=dtype), rand(3, 4, 5, dtype=dtype),
                            rand(3, 5, 6, dtype=dtype, seed=1), beta=beta, alpha=alpha,
                            **tolerances(dtype, 5 + 1, max(1, abs(alpha), abs(beta))))


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (0, 3)])
def test_addbmm(beta, alpha):
    assert_lowering_matches(aten.addbmm.default, rand(4, 6), rand(3, 4, 5), rand(3, 5, 6, seed=1),
                            beta=beta, alpha=alpha)


@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES) + [torch.int64])
def test_vector_products(dtype):
    tol = tolerances(dtype, 7)
    a, b, m = rand(7, dtype=dtype), rand(7, dtype=dtype, seed=1), rand(5, 7, dtype=dtype)
    assert_lowering_matches(aten.dot.default, a, b, **tol)
    assert_lowering_matches(aten.mv.default, m, a, **tol)
    assert_lowering_matches(aten.outer.default, a, b, **tol)


def test_vdot_conjugates_first_argument():
    a = torch.randn(6, dtype=torch.complex64)
    b = torch.randn(6, dtype=torch.complex64)
    assert_lowering_matches(aten.vdot.default, a, b)
    assert_lowering_matches(aten.vdot.default, rand(6), rand(6, seed=4))


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (0, 1)])
def test_addmv(beta, alpha):
    assert_lowering_matches(aten.addmv.default, rand(5), rand(5, 7), rand(7, seed=1), beta=beta, alpha=alpha)


def test_matmul_precision_setting():
    assert matmul.get_matmul_precision() == "highest"
    try:
        matmul.set_matmul_precision("medium")
        assert matmul.get_matmul_precision() == "medium"
        with pytest.raises(ValueError):
            matmul.set_matmul_precision("fast")
        assert matmul.get_matmul_precision() == "medium"
    finally:
        matmul.set_matmul_precision("highest")


@pytest.mark.parametrize("precision,expected", [("highest", lax.Precision.HIGHEST),
                                                ("high", lax.Precision.HIGH),
                                                ("medium", lax.Precision.DEFAULT)])
def test_matmul_precision_reaches_the_dot(precision, expected):

    try:
        matmul.set_matmul_precision(precision)
        jaxpr = jax.make_jaxpr(matmul.mm)(jnp.ones((2, 3)), jnp.ones((3, 4)))
    finally:
        matmul.set_matmul_precision("highest")
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1
    assert tuple(dots[0].params["precision"]) == (expected, expected)


def test_changing_precision_retraces_an_already_jitted_lowering():
    """Eager lowerings are wrapped in jax.jit: a precision change must not hit a stale cache."""
    jitted = jax.jit(matmul.mm)
    x, y = jnp.ones((2, 3)), jnp.ones((3, 4))
    try:
        matmul.set_matmul_precision("highest")
        assert "HIGHEST" in jitted.lower(x, y).as_text()
        matmul.set_matmul_precision("medium")
        assert "HIGHEST" not in jitted.lower(x, y).as_text()
    finally:
        matmul.set_matmul_precision("highest")


def _dots(jaxpr) -> list:
    """The dot_general equations of ``jaxpr``, nested ones (custom_vjp, jit) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", None)
            if inner is not None:
                found.extend(_dots(inner if hasattr(inner, "eqns") else inner.jaxpr))
    return found


def test_bf16_mm_accumulates_in_f32():

    a, b = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)
    (dot,) = _dots(jax.make_jaxpr(matmul.mm)(a, b).jaxpr)
    # Rounded to bf16 by the dot itself (nothing is added before torch's rounding); the exact
    # long sum below shows the accumulation inside is f32. addmm keeps its f32 product.
    assert dot.params["preferred_element_type"] == jnp.bfloat16
    (dot,) = _dots(jax.make_jaxpr(matmul.addmm)(jnp.ones((4,), jnp.bfloat16), a, b).jaxpr)
    assert dot.params["preferred_element_type"] == jnp.float32
    # Differentiated by JAX, the backward products are bf16 x bf16 like torch's mm backward
    # (f32 accumulation inside the dot, rounded to bf16), not f32 x f32.
    grads = jax.make_jaxpr(jax.grad(lambda x, y: matmul.mm(x, y).astype(jnp.float32).sum(),
                                    argnums=(0, 1)))(a, b)
    dots = _dots(grads.jaxpr)
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    assert len(dots) == 3
    assert all(e.params["preferred_element_type"] == jnp.bfloat16 for e in dots)
    # A long bf16 sum whose partial sums would lose bits if rounded to bf16 each step.
    a = torch.full((1, 4096), 1.0, dtype=torch.bfloat16)
    b = torch.full((4096, 1), 1.0 + 2 ** -7, dtype=torch.bfloat16)
    assert_lowering_matches(aten.mm.default, a, b, atol=0, rtol=0)
    assert_lowering_matches(aten.bmm.default, a[None], b[None], atol=0, rtol=0)


# --- linear algebra ------------------------------------------------------------------------


def spd(n, batch=()):
    a = rand(*batch, n, n, seed=5)
    return a @ a.mT + n * torch.eye(n)


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky(upper):
    assert_lowering_matches(aten.linalg_cholesky_ex.default, spd(4, (2,)), upper=upper, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("unitriangular", [False, True])
def test_triangular_solve(upper, transpose, unitriangular):
    a = spd(4, (2,))
    tri = a.triu() if upper else a.tril()
    assert_lowering_matches(aten.triangular_solve.default, rand(2, 4, 3), tri, upper=upper,
                            transpose=transpose, unitriangular=unitriangular, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("left", [True, False])
def test_linalg_solve(left):
    assert_lowering_matches(aten.linalg_solve_ex.default, spd(4, (2,)), rand(2, 4, 3) if left else rand(2, 3, 4),
                            left=left, atol=1e-4, rtol=1e-4)
    assert_lowering_matches(aten.linalg_solve_ex.default, spd(4), rand(4), atol=1e-4, rtol=1e-4)


def test_linalg_inverse():
    assert_lowering_matches(aten.linalg_inv_ex.default, spd(5, (3,)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["reduced", "complete"])
@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (2, 4, 4)])
def test_qr_reconstructs(mode, shape):
    a = rand(*shape)
    (q, r), (eq, er) = run_lowering(aten.linalg_qr.default, a, mode)
    assert q.shape == eq.shape and r.shape == er.shape
    torch.testing.assert_close(q @ r, a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(r, r.triu())
    torch.testing.assert_close(q.mT @ q, torch.eye(q.shape[-1]).expand_as(q.mT @ q), atol=1e-4, rtol=1e-4)


def test_eigh():
    a = spd(4, (2,))
    (values, vectors), (ev, _) = run_lowering(aten._linalg_eigh.default, a)
    torch.testing.assert_close(values, ev, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(vectors @ torch.diag_embed(values) @ vectors.mT, a, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("full_matrices", [False, True])
def test_svd(full_matrices):
    a = rand(2, 5, 3)
    (u, s, vh), (eu, es, evh) = run_lowering(aten._linalg_svd.default, a, full_matrices)
    assert (u.shape, s.shape, vh.shape) == (eu.shape, es.shape, evh.shape)
    torch.testing.assert_close(s, es, atol=1e-4, rtol=1e-4)
    k = s.shape[-1]
    torch.testing.assert_close(u[..., :k] @ torch.diag_embed(s) @ vh[..., :k, :], a, atol=1e-4, rtol=1e-4)


def test_trilinear_bilinear_kernel():
    # the call nn.functional.bilinear makes: x1 [N, I], W [O, I, J], x2 [N, J] -> [N, O]
    x1, w, x2 = rand(3, 4), rand(5, 4, 2, seed=1), rand(3, 2, seed=2)
    assert_lowering_matches(aten._trilinear.default, x1, w, x2, [1, 3], [0], [1, 2], [2, 3],
                            **tolerances(torch.float32, 8))
