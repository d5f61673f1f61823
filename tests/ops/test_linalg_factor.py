"""Factorization, solve, determinant and pseudo-inverse lowerings against PyTorch on CPU."""

import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches
from tests.tolerances import rtol_for

aten = torch.ops.aten
TOL = dict(atol=2e-5, rtol=2e-5)


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def well_conditioned(*shape, seed=0):
    return rand(*shape, seed=seed) + 3 * torch.eye(shape[-1])


def spd(*shape, seed=0):
    a = rand(*shape, seed=seed)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1])


@pytest.mark.parametrize("shape", [(4, 4), (2, 5, 3), (3, 5)])
def test_lu_factor_and_unpack(shape):
    a = rand(*shape)
    assert_lowering_matches(aten.linalg_lu_factor_ex.default, a, **TOL)
    assert_lowering_matches(aten.linalg_lu.default, a, **TOL)
    lu, pivots = torch.linalg.lu_factor(a)
    assert_lowering_matches(aten.lu_unpack.default, lu, pivots, **TOL)


@pytest.mark.parametrize("left,adjoint", [(True, False), (True, True), (False, False),
                                          (False, True)])
def test_lu_solve(left, adjoint):
    lu, pivots = torch.linalg.lu_factor(rand(2, 4, 4, seed=1))
    b = rand(2, 4, 3, seed=2) if left else rand(2, 3, 4, seed=2)
    assert_lowering_matches(aten.linalg_lu_solve.default, lu, pivots, b, left=left,
                            adjoint=adjoint, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("b_shape,left", [((4, 2), True), ((4,), True), ((2, 4), False)])
def test_solve(b_shape, left):
    out = aten._linalg_solve_ex.default
    assert_lowering_matches(out, well_conditioned(4, 4), rand(*b_shape, seed=3), left=left,
                            **TOL)


def test_det_slogdet():
    a = rand(3, 4, 4, seed=4)
    assert_lowering_matches(aten._linalg_det.default, a, **TOL)
    # log|det| sums the logs of U's diagonal: an LU of 4 chained eliminations (reductions of
    # up to 4 terms), then one log each, whose accuracy is the platform's (a TPU's float32 log
    # measures ~1,400 u).
    rtol = rtol_for(torch.float32, reduction=4, depth=4, functions=("log",))
    assert_lowering_matches(aten._linalg_slogdet.default, a, atol=0.0, rtol=rtol)


@pytest.mark.parametrize("upper,left,unit", [(True, True, False), (False, False, True)])
def test_solve_triangular(upper, left, unit):
    a = well_conditioned(4, 4, seed=5)
    a = a.triu() if upper else a.tril()
    b = rand(4, 2, seed=6) if left else rand(2, 4, seed=6)
    assert_lowering_matches(aten.linalg_solve_triangular.default, a, b, upper=upper, left=left,
                            unitriangular=unit, **TOL)


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_family(upper):
    a = spd(4, 4, seed=7)
    factor = torch.linalg.cholesky(a, upper=upper)
    assert_lowering_matches(aten.cholesky.default, a, upper, **TOL)
    assert_lowering_matches(aten.cholesky_solve.default, rand(4, 2, seed=8), factor, upper,
                            **TOL)
    assert_lowering_matches(aten.cholesky_inverse.default, factor, upper, **TOL)


def test_eig():
    assert_lowering_matches(aten.linalg_eig.default, rand(4, 4, seed=9), **TOL)


@pytest.mark.parametrize("shape", [(4, 4), (3, 5, 5)])
def test_eig_on_the_host_matches_cpu_torch(shape):
    """Where XLA has no eig (a TPU), the lowering computes it on the host inside the program;
    here that path runs on the CPU client, jitted and under vmap, against CPU PyTorch."""
    import jax
    import numpy as np

    from tpu_train.ops.linalg_factor import eig_on_host

    a = rand(*shape, seed=11)
    want_values, want_vectors = torch.linalg.eig(a)
    values, vectors = jax.jit(eig_on_host)(a.numpy())
    torch.testing.assert_close(torch.from_numpy(np.array(values)), want_values, **TOL)
    torch.testing.assert_close(torch.from_numpy(np.array(vectors)), want_vectors, **TOL)
    if len(shape) == 3:
        values, vectors = jax.jit(jax.vmap(eig_on_host))(a.numpy())
        torch.testing.assert_close(torch.from_numpy(np.array(vectors)), want_vectors, **TOL)


@pytest.mark.parametrize("hermitian", [False, True])
def test_pinv(hermitian):
    a = spd(4, 4, seed=10) if hermitian else rand(5, 3, seed=10)
    assert_lowering_matches(aten.linalg_pinv.atol_rtol_tensor, a, hermitian=hermitian, **TOL)


@pytest.mark.parametrize("driver", ["gelsy", "gelsd", "gels"])
def test_lstsq(driver):
    a, b = rand(6, 3, seed=11), rand(6, 2, seed=12)
    assert_lowering_matches(aten.linalg_lstsq.default, a, b, driver=driver, **TOL)


def test_householder_pieces():
    a, c = rand(5, 3, seed=13), rand(5, 2, seed=14)
    qr, tau = torch.geqrf(a)
    assert_lowering_matches(aten.geqrf.default, a, **TOL)
    assert_lowering_matches(aten.linalg_householder_product.default, qr, tau, **TOL)
    assert_lowering_matches(aten.ormqr.default, qr, tau, c, True, True, **TOL)


def test_matrix_exp():
    assert_lowering_matches(aten.linalg_matrix_exp.default, 0.5 * rand(3, 3, seed=15), **TOL)
