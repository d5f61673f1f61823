"""Lowerings of matrix factorizations and the solves, determinants and inverses built on them.

LU (``linalg_lu_factor_ex``, ``linalg_lu``, ``lu_unpack``, ``linalg_lu_solve``), the LU-based
``_linalg_solve_ex``, ``_linalg_det`` and ``_linalg_slogdet``; triangular and Cholesky solves;
``linalg_eig`` (on the host where XLA has no ``eig``: :func:`eig_on_host`); pseudo-inverse,
least squares and the matrix exponential; Householder QR pieces (``geqrf``,
``linalg_householder_product``, ``ormqr``).

They follow the LAPACK conventions PyTorch exposes: LU pivots are 1-based int32 row swaps
(``getrf``), ``A = P L U`` with a unit lower ``L``. On the CPU client JAX calls the same LAPACK
routines, so factors agree with CPU PyTorch, not just products of them. ``info`` outputs are 0:
a compiled program cannot raise on a singular matrix (see ``matmul._info``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from tpu_train.ops.matmul import _info, _mT
from tpu_train.ops.registry import aten, lowers


def _mH(a):
    return jnp.conj(_mT(a)) if jnp.iscomplexobj(a) else _mT(a)


def _matmul(a, b):
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def _broadcast_batch(a, b):
    """``a`` and ``b`` (matrices) broadcast to their common batch shape."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return (jnp.broadcast_to(a, batch + a.shape[-2:]),
            jnp.broadcast_to(b, batch + b.shape[-2:]))


def _tri_solve(a, b, *, lower, left=True, adjoint=False, unit=False):
    """Solve ``op(a) x = b`` (``left``) or ``x op(a) = b``, ``a`` triangular, ``op`` = adjoint?"""
    a, b = _broadcast_batch(a, b)
    dtype = jnp.result_type(a, b)
    return lax.linalg.triangular_solve(
        a.astype(dtype), b.astype(dtype), left_side=left, lower=lower, transpose_a=adjoint,
        conjugate_a=adjoint and jnp.issubdtype(dtype, jnp.complexfloating), unit_diagonal=unit)


# ---------------------------------------------------------------------------------------------
# LU


def _lu(A):
    """(LU, 0-based pivots, permutation) of ``A`` with partial pivoting (LAPACK getrf)."""
    return lax.linalg.lu(A)


def _permutation(pivots0, m):
    return lax.linalg.lu_pivots_to_permutation(pivots0, m)


@lowers(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(A, *, pivot=True, check_errors=False):
    if not pivot:
        raise NotImplementedError("linalg.lu_factor: LU without pivoting is not supported")
    lu, pivots, _ = _lu(A)
    return lu, pivots + 1, _info(A)


def _unpack(lu, perm):
    """P, L, U of a packed LU and its row permutation (``A[perm] = L U``)."""
    m, n = lu.shape[-2:]
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    upper = jnp.triu(lu[..., :k, :])
    # P[perm[i], i] = 1, so that A = P L U.
    P = _mT(jax.nn.one_hot(perm, m, dtype=lu.dtype))
    return P, lower, upper


@lowers(aten.linalg_lu.default)
def linalg_lu(A, *, pivot=True):
    if not pivot:
        raise NotImplementedError("linalg.lu: LU without pivoting is not supported")
    lu, _, perm = _lu(A)
    return _unpack(lu, perm)


@lowers(aten.lu_unpack.default)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    m = LU_data.shape[-2]
    perm = _permutation(LU_pivots.astype(jnp.int32) - 1, m)
    P, lower, upper = _unpack(LU_data, perm)
    empty = jnp.zeros((0,), LU_data.dtype)
    return (P if unpack_pivots else empty,
            lower if unpack_data else empty, upper if unpack_data else empty)


def _lu_solve_left(lu, perm, B, adjoint):
    """Solve ``A X = B`` (or ``A^H X = B``) for ``A[perm] = L U``."""
    batch = jnp.broadcast_shapes(lu.shape[:-2], B.shape[:-2])
    lu = jnp.broadcast_to(lu, batch + lu.shape[-2:])
    B = jnp.broadcast_to(B, batch + B.shape[-2:])
    perm = jnp.broadcast_to(perm, batch + perm.shape[-1:])
    if not adjoint:
        pb = jnp.take_along_axis(B, perm[..., :, None], axis=-2)
        y = _tri_solve(lu, pb, lower=True, unit=True)
        return _tri_solve(lu, y, lower=False)
    # A^H = U^H L^H P^T: X = P L^-H U^-H B.
    y = _tri_solve(lu, B, lower=False, adjoint=True)
    z = _tri_solve(lu, y, lower=True, adjoint=True, unit=True)
    inverse = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(z, inverse[..., :, None], axis=-2)


def _lu_solve(lu, perm, B, left, adjoint):
    if left:
        return _lu_solve_left(lu, perm, B, adjoint)
    # X A = B  <=>  A^H X^H = B^H;  X A^H = B  <=>  A X^H = B^H.
    return _mH(_lu_solve_left(lu, perm, _mH(B), not adjoint))


@lowers(aten.linalg_lu_solve.default)
def linalg_lu_solve(LU, pivots, B, *, left=True, adjoint=False):
    perm = _permutation(pivots.astype(jnp.int32) - 1, LU.shape[-2])
    return _lu_solve(LU, perm, B, left, adjoint)


@lowers(aten._linalg_solve_ex.default)
def linalg_solve_ex_lu(A, B, *, left=True, check_errors=False):
    # torch.linalg.solve's vector case: B of shape A.shape[:-1] (or 1-D) is a column.
    vector = B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])
    lu, pivots, perm = _lu(A)
    rhs = B[..., None] if vector else B
    if vector and not left:
        rhs = B[..., None, :]
    result = _lu_solve(lu, perm, rhs, left, False)
    if vector:
        result = result[..., 0] if left else result[..., 0, :]
    return result, lu, pivots + 1, _info(A)


def _lu_diagonal_and_parity(A):
    # CPU PyTorch factors A^T here (the column-major view of a contiguous A; det(A^T) = det(A))
    # and its backward formulas read the saved LU as such: do the same.
    lu, pivots, _ = _lu(_mT(A))
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(pivots != jnp.arange(pivots.shape[-1], dtype=pivots.dtype), axis=-1)
    parity = jnp.where(swaps % 2 == 1, -1, 1).astype(A.dtype)
    return lu, pivots + 1, diagonal, parity


@lowers(aten._linalg_det.default)
def linalg_det(A):
    lu, pivots, diagonal, parity = _lu_diagonal_and_parity(A)
    return parity * jnp.prod(diagonal, axis=-1), lu, pivots


@lowers(aten._linalg_slogdet.default)
def linalg_slogdet(A):
    lu, pivots, diagonal, parity = _lu_diagonal_and_parity(A)
    magnitude = jnp.abs(diagonal)
    if jnp.iscomplexobj(A):
        sign = parity * jnp.prod(diagonal / magnitude, axis=-1)
    else:
        sign = parity * jnp.prod(jnp.sign(diagonal), axis=-1)
    return sign, jnp.sum(jnp.log(magnitude), axis=-1), lu, pivots


# ---------------------------------------------------------------------------------------------
# Triangular and Cholesky


@lowers(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(self, B, *, upper, left=True, unitriangular=False):
    return _tri_solve(self, B, lower=not upper, left=left, unit=unitriangular)


@lowers(aten.cholesky.default)
def cholesky(self, upper=False):
    lower = jnp.linalg.cholesky(self, symmetrize_input=False)
    return _mH(lower) if upper else lower


def _cholesky_lower(factor, upper):
    return _mH(factor) if upper else factor


@lowers(aten.cholesky_solve.default)
def cholesky_solve(self, input2, upper=False):
    # A = L L^H: X = L^-H L^-1 B.
    lower = _cholesky_lower(input2, upper)
    y = _tri_solve(lower, self, lower=True)
    return _tri_solve(lower, y, lower=True, adjoint=True)


@lowers(aten.cholesky_inverse.default)
def cholesky_inverse(self, upper=False):
    lower = _cholesky_lower(self, upper)
    eye = jnp.broadcast_to(jnp.eye(lower.shape[-1], dtype=lower.dtype), lower.shape)
    inv_lower = _tri_solve(lower, eye, lower=True)
    return _matmul(_mH(inv_lower), inv_lower)


# ---------------------------------------------------------------------------------------------
# Eigenvalues, pseudo-inverse, least squares, matrix exponential


def _eig_with_cpu_torch(a):
    """CPU PyTorch's own ``linalg.eig`` (LAPACK's ``geev``): its eigenvectors' phases too."""
    values, vectors = torch.linalg.eig(torch.from_numpy(np.array(a)))
    return values.numpy(), vectors.numpy()


def eig_on_host(a):
    """The eigendecomposition of ``a`` computed on the host by CPU PyTorch, inside the program
    (a callback): XLA has a general (non-symmetric) ``eig`` on its CPU backend only."""
    complex_dtype = jnp.result_type(a.dtype, jnp.complex64)
    shapes = (jax.ShapeDtypeStruct(a.shape[:-1], complex_dtype),
              jax.ShapeDtypeStruct(a.shape, complex_dtype))
    return jax.pure_callback(_eig_with_cpu_torch, shapes, a, vmap_method="expand_dims")


@lowers(aten.linalg_eig.default)
def linalg_eig(self):
    def with_xla(a):
        values, vectors = lax.linalg.eig(a, compute_left_eigenvectors=False)
        return values, vectors

    return lax.platform_dependent(self, cpu=with_xla, default=eig_on_host)


def _pinv_tolerance(values, largest, atol, rtol, shape, dtype):
    """max(atol, rtol * largest), with torch's defaults: rtol = eps * max(m, n) unless only a
    positive atol is given (then rtol = 0)."""
    real = jnp.finfo(dtype).dtype
    default_rtol = jnp.finfo(real).eps * max(shape[-2:])
    if rtol is None:
        rtol = (jnp.asarray(default_rtol, real) if atol is None
                else jnp.where(atol > 0, 0.0, default_rtol).astype(real))
    atol = jnp.zeros((), real) if atol is None else atol
    return jnp.maximum(jnp.asarray(atol)[..., None], jnp.asarray(rtol)[..., None] * largest)


@lowers(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(self, *, atol=None, rtol=None, hermitian=False):
    if hermitian:
        values, vectors = jnp.linalg.eigh(self, UPLO="L", symmetrize_input=False)
        magnitude = jnp.abs(values)
        tol = _pinv_tolerance(values, jnp.max(magnitude, -1, keepdims=True), atol, rtol,
                              self.shape, self.dtype)
        inverse = jnp.where(magnitude > tol, 1 / values, 0).astype(self.dtype)
        return _matmul(vectors * inverse[..., None, :], _mH(vectors))
    u, s, vh = jnp.linalg.svd(self, full_matrices=False)
    tol = _pinv_tolerance(s, s[..., :1], atol, rtol, self.shape, self.dtype)
    inverse = jnp.where(s > tol, 1 / s, 0).astype(self.dtype)
    return _matmul(_mH(vh) * inverse[..., None, :], _mH(u))


@lowers(aten.linalg_lstsq.default)
def linalg_lstsq(self, b, rcond=None, *, driver=None):
    """Least squares through the SVD: the minimum-norm solution LAPACK's gelsy / gelsd give.
    ``residuals`` and ``singular_values`` follow torch's rules per driver (empty when torch
    leaves them empty); ``rank`` counts singular values above ``rcond * s_max``."""
    driver = driver or "gelsy"
    m, n = self.shape[-2:]
    vector = b.ndim == self.ndim - 1
    rhs = b[..., None] if vector else b
    A, rhs = _broadcast_batch(self, rhs)
    if rcond is None:
        rcond = jnp.finfo(jnp.finfo(A.dtype).dtype).eps * max(m, n)
    u, s, vh = jnp.linalg.svd(A, full_matrices=False)
    keep = s > rcond * s[..., :1]
    inverse = jnp.where(keep, 1 / s, 0).astype(A.dtype)
    solution = _matmul(_mH(vh) * inverse[..., None, :], _matmul(_mH(u), rhs))
    rank = jnp.sum(keep, axis=-1).astype(jnp.int32)
    real = s.dtype
    empty = jnp.zeros((0,), real)
    residuals = empty
    if m > n and driver != "gelsy":
        fitted = _matmul(A, solution)
        residuals = jnp.sum(jnp.abs(fitted - rhs) ** 2, axis=-2)
        residuals = jnp.where((rank == n)[..., None], residuals, 0)
    if vector:
        solution = solution[..., 0]
    rank_out = rank if driver != "gels" else jnp.zeros((0,), jnp.int32)
    singular = s if driver in ("gelsd", "gelss") else empty
    return solution, residuals, rank_out, singular


@lowers(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(self):
    # JAX's expm takes no 16-bit floats: compute in float32 (the caller rounds the result).
    if self.dtype in (jnp.bfloat16, jnp.float16):
        self = self.astype(jnp.float32)
    return jax.scipy.linalg.expm(self)


# ---------------------------------------------------------------------------------------------
# Householder QR pieces


@lowers(aten.geqrf.default)
def geqrf(self):
    from jax._src.lax import linalg as lax_linalg  # geqrf has no public name in jax.lax.linalg

    return lax_linalg.geqrf(self)


@lowers(aten.linalg_householder_product.default)
def linalg_householder_product(input, tau):
    return lax.linalg.householder_product(input, tau)


@lowers(aten.ormqr.default)
def ormqr(self, input2, input3, left=True, transpose=False):
    return lax.linalg.ormqr(self, input2, input3, left=left, transpose=transpose)
