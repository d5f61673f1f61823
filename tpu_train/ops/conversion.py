"""Dtype conversion, copies and value factories, plus PyTorch's type-promotion rules.

The promotion helpers here are shared by every pointwise-style family: JAX's own promotion
differs from PyTorch's (a 0-dim array is a full participant in JAX, whereas PyTorch lets a 0-dim
tensor or a Python scalar raise only the *category* of the result), so lowerings compute the
result dtype the PyTorch way and cast their operands to it explicitly.

Factories (``full``, ``zeros``, ``arange``...) are value lowerings for the compiled step; the
eager device layer registers its own allocating kernels.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpu_train.ops.dtypes import storage_dtype
from tpu_train.ops.registry import aten, lowers

# ----------------------------------------------------------------------------- promotion

_BOOL, _INT, _FLOAT, _COMPLEX = range(4)
DEFAULT_FLOAT = jnp.dtype(jnp.float32)
DEFAULT_INT = jnp.dtype(jnp.int32)  # torch's int64, as stored with x64 off
_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _category(dtype) -> int:
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return _BOOL
    if jnp.issubdtype(dtype, jnp.integer):
        return _INT
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return _COMPLEX
    return _FLOAT


def scalar_dtype(value):
    """The dtype PyTorch gives a Scalar argument: Python bool/int/float/complex → default types.

    A float Scalar may arrive as a JAX array (a tracer in eager mode); its category decides.
    """
    if isinstance(value, (bool, np.bool_)):
        return jnp.dtype(jnp.bool_)
    if isinstance(value, (int, np.integer)):
        return DEFAULT_INT
    if isinstance(value, (float, np.floating)):
        return DEFAULT_FLOAT
    if isinstance(value, complex):
        return jnp.dtype(jnp.complex64)
    return {_BOOL: jnp.dtype(jnp.bool_), _INT: DEFAULT_INT, _FLOAT: DEFAULT_FLOAT,
            _COMPLEX: jnp.dtype(jnp.complex64)}[_category(jnp.result_type(value))]


def _promote_all(dtypes):
    result = None
    for dtype in dtypes:
        result = dtype if result is None else jnp.promote_types(result, dtype)
    return None if result is None else jnp.dtype(result)


def _combine_categories(higher, lower):
    """c10's ``combine_categories``: a lower tier only lifts the category of a higher one."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    if _category(higher) == _COMPLEX:
        return higher
    if _category(lower) == _COMPLEX:
        return jnp.dtype(jnp.complex64) if _category(higher) == _FLOAT else lower
    if _category(higher) == _FLOAT:
        return higher
    if _category(higher) == _BOOL or _category(lower) == _FLOAT:
        return jnp.dtype(jnp.promote_types(higher, lower))
    return higher


def result_dtype(*tensors, scalars=()):
    """PyTorch's ``result_type`` over tensor operands (JAX arrays) and Scalar operands.

    Three tiers as in c10: tensors with dims, 0-dim tensors, then scalars; a lower tier only
    counts when its category (bool < int < float < complex) is higher than the tier above.
    """
    dims = _promote_all(jnp.dtype(t.dtype) for t in tensors if t is not None and jnp.ndim(t) > 0)
    zero_dims = _promote_all(
        jnp.dtype(t.dtype) for t in tensors if t is not None and jnp.ndim(t) == 0)
    wrapped = _promote_all(scalar_dtype(s) for s in scalars if s is not None)
    result = _combine_categories(dims, _combine_categories(zero_dims, wrapped))
    if result is None:
        raise TypeError("result_dtype needs at least one operand")
    return jnp.dtype(result)


def float_result_dtype(dtype):
    """The dtype of an int→float op (``exp``, ``div``...): integers and bool become float32."""
    dtype = jnp.dtype(dtype)
    return dtype if _category(dtype) >= _FLOAT else DEFAULT_FLOAT


def opmath_dtype(dtype):
    """The dtype PyTorch computes in: bf16/f16 math runs in float32, as torch's opmath does."""
    dtype = jnp.dtype(dtype)
    return DEFAULT_FLOAT if dtype in _LOW_PRECISION else dtype


def is_floating(dtype) -> bool:
    return _category(dtype) == _FLOAT


def is_integral(dtype, include_bool: bool = False) -> bool:
    category = _category(dtype)
    return category == _INT or (include_bool and category == _BOOL)


def cast_scalar(value, dtype):
    """A Scalar as a 0-dim array of ``dtype`` (works for Python numbers and tracers alike)."""
    return jnp.asarray(value).astype(dtype) if not isinstance(value, (bool, int, float, complex)) \
        else jnp.asarray(value, dtype=dtype)


def promote(*tensors, scalars=(), to_float: bool = False):
    """Cast tensors and scalars to their common PyTorch dtype.

    Returns ``(result_dtype, compute_dtype, cast_tensors, cast_scalars)``; operands are cast to
    the result dtype first and then widened to the compute (opmath) dtype, except scalars of a
    bf16/f16 op, which go straight to opmath as in PyTorch's kernels.
    """
    dtype = result_dtype(*tensors, scalars=scalars)
    if to_float:
        dtype = float_result_dtype(dtype)
    compute = opmath_dtype(dtype)

    def cast(x, is_scalar):
        if x is None:
            return None
        if dtype != compute and (is_scalar or jnp.ndim(x) == 0):
            # A scalar (or 0-dim) operand of a bf16/f16 op keeps its full value: PyTorch reads
            # the original scalar in opmath precision instead of rounding it to bf16 first.
            return cast_scalar(x, compute)
        x = cast_scalar(x, dtype) if is_scalar else jnp.asarray(x).astype(dtype)
        return x.astype(compute)

    return (dtype, compute, [cast(t, False) for t in tensors],
            [cast(s, True) for s in scalars])


def torch_default_dtype(dtype: torch.dtype | None, fallback):
    """The storage dtype for an optional ``dtype=`` argument."""
    return jnp.dtype(fallback) if dtype is None else jnp.dtype(storage_dtype(dtype))


# ----------------------------------------------------------------------------- conversions


def convert(x, dtype):
    """``x.to(dtype)`` with PyTorch's value semantics (float→int truncates, →bool is ``!= 0``)."""
    dtype = jnp.dtype(dtype)
    x = jnp.asarray(x)
    if x.dtype == dtype:
        return x
    if dtype == jnp.bool_:
        return x != 0
    if jnp.issubdtype(x.dtype, jnp.complexfloating) and not jnp.issubdtype(dtype, jnp.complexfloating):
        x = jnp.real(x)
    return x.astype(dtype)


@lowers(aten._to_copy.default)
def to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
            memory_format=None):
    """Only the dtype changes the value; device/layout/memory format are the device layer's."""
    if dtype is None:
        return jnp.copy(self)
    result = convert(self, storage_dtype(dtype))
    return jnp.copy(result) if result is self else result


@lowers(torch.ops.prims.convert_element_type.default)
def prims_convert_element_type(a, dtype):
    """What ``renorm``'s and other decompositions cast with (a bfloat16 input's norms are
    computed in float32, then cast back)."""
    result = convert(a, storage_dtype(dtype))
    return jnp.copy(result) if result is a else result


@lowers(aten.clone.default)
def clone(self, *, memory_format=None):
    # A real copy: an eager caller may donate one of the two buffers later.
    return jnp.copy(self)


@lowers(aten.copy.default)
def copy(self, src, non_blocking=False):
    """Functional ``self.copy_(src)``: ``src`` broadcast to ``self``'s shape, cast to its dtype."""
    return jnp.broadcast_to(convert(src, self.dtype), self.shape)


@lowers(aten.fill.Scalar)
def fill_scalar(self, value):
    return jnp.full(self.shape, cast_scalar(value, self.dtype), self.dtype)


@lowers(aten.fill.Tensor)
def fill_tensor(self, value):
    return jnp.broadcast_to(convert(value, self.dtype), self.shape)


@lowers(aten.zero.default)
def zero(self):
    return jnp.zeros(self.shape, self.dtype)


def _like(self, fill, dtype):
    target = torch_default_dtype(dtype, self.dtype)
    return jnp.full(self.shape, cast_scalar(fill, target), target)


@lowers(aten.full_like.default)
def full_like(self, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None,
              memory_format=None):
    return _like(self, fill_value, dtype)


@lowers(aten.zeros_like.default)
def zeros_like(self, *, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    return _like(self, 0, dtype)


@lowers(aten.ones_like.default)
def ones_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _like(self, 1, dtype)


@lowers(aten.empty_like.default)
def empty_like(self, *, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    # Uninitialised memory has no value semantics: zeros keep results deterministic.
    return _like(self, 0, dtype)


@lowers(aten.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    target = torch_default_dtype(dtype, DEFAULT_FLOAT)
    return cast_scalar(s, target)


@lowers(aten.full.default)
def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    target = torch_default_dtype(dtype, scalar_dtype(fill_value))
    return jnp.full(tuple(size), cast_scalar(fill_value, target), target)


@lowers(aten.zeros.default)
def zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), torch_default_dtype(dtype, DEFAULT_FLOAT))


@lowers(aten.ones.default)
def ones(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), torch_default_dtype(dtype, DEFAULT_FLOAT))


def _arange(start, end, step, dtype):
    for bound in (start, end, step):
        if isinstance(bound, jax.core.Tracer):
            raise TypeError("arange bounds must be static Python numbers: they set the shape")
    if step == 0:
        raise ValueError("arange: step must be nonzero")
    all_int = all(isinstance(v, (int, np.integer)) for v in (start, end, step))
    target = torch_default_dtype(dtype, DEFAULT_INT if all_int else DEFAULT_FLOAT)
    # PyTorch sizes the result in double precision: ceil((end - start) / step).
    length = max(0, math.ceil((float(end) - float(start)) / float(step)))
    if all_int and is_integral(target):
        # Integer bounds: exact integer arithmetic whatever the output type.
        index = jnp.arange(length, dtype=target)
        return (index * jnp.asarray(step, target) + jnp.asarray(start, target)).astype(target)
    compute = opmath_dtype(target) if is_floating(target) else DEFAULT_FLOAT
    index = jnp.arange(length, dtype=compute)
    values = jnp.asarray(start, compute) + index * jnp.asarray(step, compute)
    return convert(values, target) if is_floating(target) else jnp.trunc(values).astype(target)


@lowers(aten.arange.start_step)
def arange_start_step(start, end, step=1, *, dtype=None, layout=None, device=None,
                      pin_memory=None):
    return _arange(start, end, step, dtype)


@lowers(aten.arange.start)
def arange_start(start, end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(start, end, 1, dtype)


@lowers(aten.arange.default)
def arange(end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(0, end, 1, dtype)
