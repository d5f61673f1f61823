"""Lowerings of matrix products and dense linear algebra.

``mm`` / ``addmm`` / ``bmm`` map 1:1 onto a 2-D or 3-D ``lax.dot_general`` with a single
contracting dimension: that is the form XLA tiles best, and it lets XLA fold a neighbouring
``t`` / ``permute`` into the dot instead of materialising a transpose.

Low-precision floats (bf16 / f16) are multiplied with an f32 accumulator, as PyTorch does; the
caller casts the result back to the input dtype. Every dot uses the module-level matmul
precision, named after ``torch.set_float32_matmul_precision``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from tpu_train.ops.registry import aten, lowers

_PRECISIONS = {
    "highest": lax.Precision.HIGHEST,
    "high": lax.Precision.HIGH,
    "medium": lax.Precision.DEFAULT,
}
# The same levels as names of JAX's ``jax_default_matmul_precision`` option.
_JAX_CONFIG_NAMES = {"highest": "highest", "high": "high", "medium": "default"}
_matmul_precision = "highest"


def set_matmul_precision(precision: str) -> None:
    """Set the precision of every float32 dot: ``"highest"``, ``"high"`` or ``"medium"``.

    ``"highest"`` (the default) makes f32 products match CPU PyTorch to ~1e-6; the lower
    settings let a TPU use fewer bf16 passes per f32 product.

    Like ``torch.set_float32_matmul_precision`` this is process-wide. It also sets JAX's
    ``jax_default_matmul_precision`` to the same level: that option is part of every ``jax.jit``
    cache key, so functions already compiled with the old precision are traced again instead of
    silently keeping it.
    """
    global _matmul_precision
    if precision not in _PRECISIONS:
        raise ValueError(f"matmul precision must be one of {sorted(_PRECISIONS)}, got {precision!r}")
    _matmul_precision = precision
    jax.config.update("jax_default_matmul_precision", _JAX_CONFIG_NAMES[precision])


def get_matmul_precision() -> str:
    return _matmul_precision


def jax_precision_name() -> str:
    """The current matmul precision as a value of JAX's ``jax_default_matmul_precision``."""
    return _JAX_CONFIG_NAMES[_matmul_precision]


def lax_precision() -> lax.Precision:
    """The ``lax.Precision`` of the current matmul precision, for dots and convolutions elsewhere."""
    return _PRECISIONS[_matmul_precision]


def accumulator_dtype(*arrays):
    """The dtype torch accumulates a product of ``arrays`` in: f32 for bf16/f16, else their own."""
    dtype = jnp.result_type(*arrays)
    if dtype in (jnp.bfloat16, jnp.float16):
        return jnp.float32
    return dtype


def dot_general(a, b, contracting, batch=((), ()), *, rounded: bool = False):
    """A ``lax.dot_general`` with torch's accumulation dtype and the current precision.

    bf16 / f16 operands give an f32 product (the caller rounds it to the operands' dtype, as
    torch does), or with ``rounded`` the product rounded to their dtype by the dot itself
    (f32 accumulation inside, one rounding: the same value). A product that nothing is added
    to before its rounding (``mm``, ``bmm``) is better rounded inside: XLA's TPU compiler then
    fuses what follows it (a residual add, a norm's statistics) into the dot, as for the JAX
    reference's bf16 dots, where a float32 result and its conversion were written back to HBM
    in float32 first (W1 for a v5e: a float32 [1024, 512] per projection). Its gradient is
    taken like PyTorch's ``mm`` backward: products of the low-precision incoming gradient with
    the low-precision operands. Left to JAX's own transpose rule, the f32 product's f32
    cotangent would make every backward product an f32 one (multi-pass on a TPU's matrix
    unit) when JAX differentiates a compiled step."""
    dtype = jnp.result_type(a, b)
    a, b = a.astype(dtype), b.astype(dtype)
    if accumulator_dtype(a, b) != dtype:
        return _low_precision_dot(a, b, (tuple(map(tuple, contracting)),
                                         tuple(map(tuple, batch))), lax_precision(),
                                  jnp.dtype(dtype) if rounded else jnp.dtype(jnp.float32))
    return lax.dot_general(a, b, (contracting, batch), precision=lax_precision())


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _low_precision_dot(a, b, dimension_numbers, precision, out_dtype):
    return lax.dot_general(a, b, dimension_numbers, precision=precision,
                           preferred_element_type=out_dtype)


def _low_precision_dot_forward(a, b, dimension_numbers, precision, out_dtype):
    return _low_precision_dot(a, b, dimension_numbers, precision, out_dtype), (a, b)


def _low_precision_dot_backward(dimension_numbers, precision, out_dtype, operands, cotangent):
    a, b = operands

    def rounded_product(a, b):  # f32 accumulation inside the dot, rounded to a's dtype
        return lax.dot_general(a, b, dimension_numbers, precision=precision,
                               preferred_element_type=a.dtype)

    cotangent = cotangent.astype(a.dtype)
    (grad_a,) = jax.linear_transpose(lambda x: rounded_product(x, b), a)(cotangent)
    (grad_b,) = jax.linear_transpose(lambda y: rounded_product(a, y), b)(cotangent)
    return grad_a, grad_b


_low_precision_dot.defvjp(_low_precision_dot_forward, _low_precision_dot_backward)


def _scale(x, factor):
    """``factor * x``; a static factor of 1 costs nothing."""
    if isinstance(factor, (bool, int, float)) and factor == 1:
        return x
    return x * factor


def _add_scaled_input(product, inp, beta, alpha):
    """``beta * inp + alpha * product`` where ``beta == 0`` ignores ``inp`` (even NaN), as torch."""
    product = _scale(product, alpha)
    inp = inp.astype(product.dtype)
    if isinstance(beta, (bool, int, float)):
        if beta == 0:
            return jnp.broadcast_to(product, jnp.broadcast_shapes(product.shape, inp.shape))
        return product + _scale(inp, beta)
    # A traced beta: select instead of branching, so a zero beta still drops NaN/inf inputs.
    return product + jnp.where(beta == 0, jnp.zeros_like(inp), inp * beta)


def _mm(a, b, rounded: bool = False):
    return dot_general(a, b, ((1,), (0,)), rounded=rounded)


def _bmm(a, b, rounded: bool = False):
    return dot_general(a, b, ((2,), (1,)), ((0,), (0,)), rounded=rounded)


@lowers(aten.mm.default)
def mm(self, mat2):
    return _mm(self, mat2, rounded=True)


@lowers(aten.bmm.default)
def bmm(self, mat2):
    return _bmm(self, mat2, rounded=True)


@lowers(aten.addmm.default)
def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    return _add_scaled_input(_mm(mat1, mat2), self, beta, alpha)


@lowers(aten._addmm_activation.default)
def addmm_activation(self, mat1, mat2, *, beta=1, alpha=1, use_gelu=False):
    out = _add_scaled_input(_mm(mat1, mat2), self, beta, alpha)
    if use_gelu:
        # The CPU kernel (our oracle) applies exact erf GELU; cuBLASLt's epilogue would use tanh.
        return jax.nn.gelu(out, approximate=False)
    return jnp.maximum(out, 0)


@lowers(aten.baddbmm.default)
def baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    return _add_scaled_input(_bmm(batch1, batch2), self, beta, alpha)


@lowers(aten.addbmm.default)
def addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    # Sum over the batch as part of the contraction rather than a separate reduction.
    product = dot_general(batch1, batch2, ((0, 2), (0, 1)))
    return _add_scaled_input(product, self, beta, alpha)


@lowers(aten.mv.default)
def mv(self, vec):
    return dot_general(self, vec, ((1,), (0,)))


@lowers(aten.addmv.default)
def addmv(self, mat, vec, *, beta=1, alpha=1):
    return _add_scaled_input(dot_general(mat, vec, ((1,), (0,))), self, beta, alpha)


@lowers(aten.dot.default)
def dot(self, tensor):
    return dot_general(self, tensor, ((0,), (0,)))


@lowers(aten.vdot.default)
def vdot(self, other):
    return dot_general(jnp.conj(self), other, ((0,), (0,)))


@lowers(aten.outer.default)
def outer(self, vec2):
    return self[:, None] * vec2[None, :]


# ---------------------------------------------------------------------------------------------
# Dense linear algebra. These run in f32 (there is no f64 on the device); "info" outputs are 0
# because a compiled program cannot raise on a singular matrix: torch reports the failure in
# ``info`` too, and the values then follow XLA's (NaN/inf) behaviour.


def _info(a):
    return jnp.zeros(a.shape[:-2], jnp.int32)


def _mT(a):
    return jnp.swapaxes(a, -1, -2)


@lowers(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(self, *, upper=False, check_errors=False):
    lower = jnp.linalg.cholesky(self)
    return (jnp.conj(_mT(lower)) if upper else lower), _info(self)


@lowers(aten.triangular_solve.default)
def triangular_solve(self, A, upper=True, transpose=False, unitriangular=False):
    batch = jnp.broadcast_shapes(self.shape[:-2], A.shape[:-2])
    A = jnp.broadcast_to(A, batch + A.shape[-2:])
    b = jnp.broadcast_to(self, batch + self.shape[-2:])
    solution = lax.linalg.triangular_solve(
        A, b, left_side=True, lower=not upper, transpose_a=transpose,
        unit_diagonal=unitriangular)
    return solution, A


@lowers(aten.linalg_solve_ex.default)
def linalg_solve_ex(A, B, *, left=True, check_errors=False):
    vector_rhs = B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])
    if not left:
        # X A = B  <=>  A^T X^T = B^T
        return _mT(jnp.linalg.solve(_mT(A), _mT(B))), _info(A)
    if vector_rhs:
        return jnp.linalg.solve(A, B[..., None])[..., 0], _info(A)
    return jnp.linalg.solve(A, B), _info(A)


@lowers(aten.linalg_inv_ex.default)
def linalg_inv_ex(A, *, check_errors=False):
    return jnp.linalg.inv(A), _info(A)


@lowers(aten.linalg_qr.default)
def linalg_qr(A, mode="reduced"):
    if mode == "r":
        # torch returns an empty Q in "r" mode.
        return jnp.zeros((0,), A.dtype), jnp.linalg.qr(A, mode="r")
    return jnp.linalg.qr(A, mode="complete" if mode == "complete" else "reduced")


@lowers(aten._linalg_eigh.default)
def linalg_eigh(A, UPLO="L", compute_v=True):
    values, vectors = jnp.linalg.eigh(A, UPLO=UPLO, symmetrize_input=False)
    if not compute_v:
        return values, jnp.zeros((0,), A.dtype)
    return values, vectors


@lowers(aten._linalg_svd.default)
def linalg_svd(A, full_matrices=False, compute_uv=True, *, driver=None):
    if not compute_uv:
        empty = jnp.zeros((0,), A.dtype)
        return empty, jnp.linalg.svd(A, compute_uv=False), empty
    return jnp.linalg.svd(A, full_matrices=full_matrices)


@lowers(aten._trilinear.default)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """``sum over sumdim of i1 * i2 * i3``, each first unsqueezed at its ``expand`` dims (the
    kernel of ``nn.functional.bilinear``); the summed dims are dropped."""
    def expand(x, dims):
        for d in sorted(dims):
            x = jnp.expand_dims(x, d)
        return x

    a, b, c = expand(i1, expand1), expand(i2, expand2), expand(i3, expand3)
    dtype = jnp.result_type(a, b, c)
    ab = a.astype(dtype) * b.astype(dtype)
    letters = "abcdefghijklmnopqrstuvwxyz"[:ab.ndim]
    kept = "".join(letters[d] for d in range(ab.ndim) if d not in set(sumdim))
    ab = jnp.broadcast_to(ab, jnp.broadcast_shapes(ab.shape, c.shape))
    c = jnp.broadcast_to(c.astype(dtype), ab.shape)
    return jnp.einsum(f"{letters},{letters}->{kept}", ab, c, precision=lax.Precision.HIGHEST)
