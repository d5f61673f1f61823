"""LDLᵀ factorization with Bunch–Kaufman pivoting and its solve (``linalg_ldl_factor_ex``,
``linalg_ldl_solve``), in the layout LAPACK's ``sytrf`` / ``sytrs`` give CPU PyTorch.

XLA has no symmetric-indefinite factorization, so the algorithm of LAPACK's unblocked
``sytf2`` (lower triangle, partial Bunch–Kaufman pivoting with α = (1 + √17) / 8) runs here as
a ``lax.while_loop`` over pivot steps of one or two columns. Following it step by step matters
beyond accuracy: the factors are only defined together with the pivot choices, and PyTorch
returns them packed the LAPACK way, so the same choices give the same ``LD`` and ``pivots``.

Packed form, per matrix of size n: ``LD``'s lower triangle holds the unit lower ``L`` below its
diagonal and the 1 x 1 / 2 x 2 diagonal blocks of ``D``; its strict upper triangle is zero.
``pivots`` are 1-based: ``p > 0`` at step k means rows / columns k and p were interchanged and
``D[k, k]`` is a 1 x 1 block; ``pivots[k] = pivots[k + 1] = -p`` marks a 2 x 2 block whose
second row was interchanged with p. Interchanges apply to the trailing matrix only (the
columns of ``L`` already computed are not permuted), which is why the solve replays them in
order. ``info`` is the first (1-based) step whose pivot column is all zero, else 0; real
dtypes only (the complex forms pivot on |re| + |im| and conjugate for ``hermitian``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from tpu_train.ops.registry import aten, lowers

_ALPHA = (1.0 + math.sqrt(17.0)) / 8.0


def _real_only(name, a):
    if jnp.iscomplexobj(a):
        raise NotImplementedError(f"{name} of a complex matrix is not supported on the tpu "
                                  f"device (real dtypes only)")


def _swap_trailing(m, k, kk, kp, idx):
    """Symmetric interchange of rows / columns ``kk`` and ``kp`` inside ``m[k:, k:]``."""
    perm = jnp.where(idx == kk, kp, jnp.where(idx == kp, kk, idx))
    block = (idx[:, None] >= k) & (idx[None, :] >= k)
    return jnp.where(block, m[perm][:, perm], m)


def _pivot(m, k, n, idx):
    """LAPACK's pivot choice at step ``k``: (kp, kstep, zero column?)."""
    absakk = jnp.abs(m[k, k])
    colabs = jnp.where(idx > k, jnp.abs(m[:, k]), -1.0)
    imax = jnp.argmax(colabs)
    colmax = jnp.where(k < n - 1, colabs[imax], 0.0)
    # The largest off-diagonal element of row imax: in its row left of the diagonal (from
    # column k) and in its column below.
    rowmax = jnp.maximum(
        jnp.max(jnp.where((idx >= k) & (idx < imax), jnp.abs(m[imax, :]), -1.0)),
        jnp.max(jnp.where(idx > imax, jnp.abs(m[:, imax]), -1.0)))
    zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
    keep = zero | (absakk >= _ALPHA * colmax) | (absakk >= _ALPHA * colmax * (colmax / rowmax))
    one_by_one = keep | (jnp.abs(m[imax, imax]) >= _ALPHA * rowmax)
    return jnp.where(keep, k, imax), jnp.where(one_by_one, 1, 2), zero


def _no_elimination(m, k, idx):
    return m


def _eliminate_1x1(m, k, idx):
    x = jnp.where(idx > k, m[:, k], 0)
    d11 = 1 / m[k, k]
    trailing = (idx[:, None] > k) & (idx[None, :] > k)
    m = jnp.where(trailing, m - x[:, None] * (d11 * x)[None, :], m)
    return m.at[:, k].set(jnp.where(idx > k, x * d11, m[:, k]))


def _eliminate_2x2(m, k, idx):
    d21 = m[k + 1, k]
    d11 = m[k + 1, k + 1] / d21
    d22 = m[k, k] / d21
    d21 = (1 / (d11 * d22 - 1)) / d21
    below = idx > k + 1
    a, b = m[:, k], m[:, k + 1]
    wk = jnp.where(below, d21 * (d11 * a - b), 0)
    wkp1 = jnp.where(below, d21 * (d22 * b - a), 0)
    trailing = below[:, None] & below[None, :]
    m = jnp.where(trailing, m - a[:, None] * wk[None, :] - b[:, None] * wkp1[None, :], m)
    m = m.at[:, k].set(jnp.where(below, wk, a))
    return m.at[:, k + 1].set(jnp.where(below, wkp1, b))


def _factor(a):
    """``(LD, pivots, info)`` of one n x n matrix (its lower triangle is read)."""
    n = a.shape[-1]
    idx = jnp.arange(n)
    lower = idx[:, None] >= idx[None, :]

    def step(state):
        m, pivots, info, k = state
        m = jnp.where(lower, m, m.T)  # the trailing block, symmetric, from the lower triangle
        kp, kstep, zero = _pivot(m, k, n, idx)
        kk = k + kstep - 1
        m = _swap_trailing(m, k, kk, kp, idx)
        # A zero pivot column eliminates nothing; a 2 x 2 block in the last two rows neither.
        branch = jnp.where(zero, 0, jnp.where(kstep == 1, 1, jnp.where(k < n - 2, 2, 0)))
        m = lax.switch(branch, (_no_elimination, _eliminate_1x1, _eliminate_2x2), m, k, idx)
        p = (kp + 1).astype(jnp.int32)
        pivots = pivots.at[k].set(jnp.where(kstep == 1, p, -p))
        pivots = jnp.where((kstep == 2) & (idx == k + 1), -p, pivots)
        info = jnp.where((info == 0) & zero, (k + 1).astype(jnp.int32), info)
        return m, pivots, info, k + kstep

    init = (a, jnp.zeros(n, jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    m, pivots, info, _ = lax.while_loop(lambda s: s[3] < n, step, init)
    return jnp.where(lower, m, 0), pivots, info


@lowers(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(self, *, hermitian=False, check_errors=False):
    _real_only("linalg.ldl_factor", self)
    n = self.shape[-1]
    batch = self.shape[:-2]
    if n == 0 or math.prod(batch) == 0:
        return (jnp.zeros(self.shape, self.dtype), jnp.zeros(batch + (n,), jnp.int32),
                jnp.zeros(batch, jnp.int32))
    factor = _factor
    for _ in batch:
        factor = jax.vmap(factor)
    return factor(self)


def _swap_rows(b, i, j):
    idx = jnp.arange(b.shape[0])
    return b[jnp.where(idx == i, j, jnp.where(idx == j, i, idx))]


def _replay(pivots, b, one, two, start, more):
    """``sytrs``'s loop over pivot blocks: ``one`` / ``two`` for a 1 x 1 / 2 x 2 block at row
    ``k`` return the new ``b`` and the next ``k``, from ``start`` while ``more(k)``."""
    def step(state):
        b, k = state
        return lax.cond(pivots[k] > 0, one, two, b, k, pivots[k])

    b, _ = lax.while_loop(lambda s: more(s[1]), step, (b, jnp.asarray(start, jnp.int32)))
    return b


def _solve_lower(ld, pivots, b):
    """Forward pass of ``sytrs``: ``b`` ← D⁻¹ L⁻¹ P b, replaying the interchanges in order."""
    n = ld.shape[-1]
    idx = jnp.arange(n)

    def one(b, k, p):
        b = _swap_rows(b, k, p - 1)
        b = b - jnp.where(idx > k, ld[:, k], 0)[:, None] * b[k][None, :]
        return b.at[k].set(b[k] / ld[k, k]), k + 1

    def two(b, k, p):
        b = _swap_rows(b, k + 1, -p - 1)
        b = b - jnp.where(idx > k + 1, ld[:, k], 0)[:, None] * b[k][None, :]
        b = b - jnp.where(idx > k + 1, ld[:, k + 1], 0)[:, None] * b[k + 1][None, :]
        akm1k = ld[k + 1, k]
        akm1, ak = ld[k, k] / akm1k, ld[k + 1, k + 1] / akm1k
        denom = akm1 * ak - 1
        bkm1, bk = b[k] / akm1k, b[k + 1] / akm1k
        b = b.at[k].set((ak * bkm1 - bk) / denom)
        return b.at[k + 1].set((akm1 * bk - bkm1) / denom), k + 2

    return _replay(pivots, b, one, two, 0, lambda k: k < n)


def _solve_upper(ld, pivots, b):
    """Backward pass of ``sytrs``: ``b`` ← Pᵀ L⁻ᵀ b, the interchanges replayed backwards."""
    n = ld.shape[-1]
    idx = jnp.arange(n)

    def dot_below(b, k, column):
        weights = jnp.where(idx > k, ld[:, column], 0)
        return jnp.sum(weights[:, None] * b, axis=0)

    def one(b, k, p):
        b = b.at[k].add(-dot_below(b, k, k))
        return _swap_rows(b, k, p - 1), k - 1

    def two(b, k, p):
        below = dot_below(b, k, k), dot_below(b, k, k - 1)
        b = b.at[k].add(-below[0]).at[k - 1].add(-below[1])
        return _swap_rows(b, k, -p - 1), k - 2

    return _replay(pivots, b, one, two, n - 1, lambda k: k >= 0)


@lowers(aten.linalg_ldl_solve.default)
def linalg_ldl_solve(LD, pivots, B, *, hermitian=False):
    _real_only("linalg.ldl_solve", LD)
    n = LD.shape[-1]
    batch = jnp.broadcast_shapes(LD.shape[:-2], pivots.shape[:-1], B.shape[:-2])
    LD = jnp.broadcast_to(LD, batch + LD.shape[-2:])
    pivots = jnp.broadcast_to(pivots.astype(jnp.int32), batch + pivots.shape[-1:])
    B = jnp.broadcast_to(B, batch + B.shape[-2:]).astype(LD.dtype)
    if n == 0 or B.shape[-1] == 0 or math.prod(batch) == 0:
        return B

    def solve(ld, piv, b):
        return _solve_upper(ld, piv, _solve_lower(ld, piv, b))

    for _ in batch:
        solve = jax.vmap(solve)
    return solve(LD, pivots, B)
