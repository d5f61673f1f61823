"""``_embedding_bag`` / ``_embedding_bag_forward_only``: sums, means or maxima of bags of rows.

``indices`` is 1-D (``F.embedding_bag`` flattens 2-D input and makes the offsets); bag ``b``
holds ``indices[offsets[b]:offsets[b + 1]]``, the last bag runs to the end, or to the last
offset with ``include_last_offset``. Bags are found with ``searchsorted`` over the offsets, so
shapes stay static whatever the offsets' values; rows equal to ``padding_idx`` (``-1``: none;
the functional has made it non-negative) count in no bag. An empty bag gives zeros in every
mode.

The four outputs have the shapes PyTorch's meta kernel gives a non-CPU device: the result
``(bags, D)``, ``offset2bag`` (the bag of each index), ``bag_size`` (one per offset: the bag's
count of non-padding rows, 0 for ``include_last_offset``'s last offset) and ``max_indices``
(the row chosen per bag and feature in max mode, first one on ties as ATen's loop keeps it;
empty otherwise). Sums and means accumulate in float32 for 16-bit weights.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tpu_train.ops.conversion import opmath_dtype
from tpu_train.ops.registry import aten, lowers

_SUM, _MEAN, _MAX = 0, 1, 2


def _bags(indices, offsets, include_last_offset, padding_idx):
    """``(bag per index, valid mask, number of bags, offset2bag)``; invalid indices (padding,
    before the first or past the last offset) get bag ``bags``, which is dropped."""
    n = indices.shape[0]
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    position = jnp.arange(n, dtype=offsets.dtype)
    bag = jnp.searchsorted(offsets[:bags], position, side="right") - 1
    valid = bag >= 0
    if include_last_offset:
        valid &= position < offsets[bags]
    offset2bag = jnp.where(valid, bag, 0)
    if padding_idx >= 0:
        valid &= indices != padding_idx
    return jnp.where(valid, bag, bags), valid, bags, offset2bag


@lowers(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """Returns ``(output, offset2bag, bag_size, max_indices)`` (see the module docstring)."""
    bag, valid, bags, offset2bag = _bags(indices, offsets, include_last_offset, padding_idx)
    compute = opmath_dtype(weight.dtype)
    rows = jnp.take(weight, indices, axis=0, mode="clip").astype(compute)
    count = jax.ops.segment_sum(valid.astype(jnp.int32), bag, bags + 1)[:bags]
    max_indices = jnp.zeros((0,), indices.dtype)
    if mode == _MAX:
        masked = jnp.where(valid[:, None], rows, -jnp.inf)
        out = jax.ops.segment_max(masked, bag, bags + 1)[:bags]
        hit = valid[:, None] & (masked == out[bag.clip(0, bags - 1)])
        position = jnp.arange(indices.shape[0])[:, None]
        first = jax.ops.segment_min(jnp.where(hit, position, indices.shape[0]), bag, bags + 1)
        first = first[:bags]
        empty = count[:, None] == 0
        max_indices = jnp.where(empty, 0, indices[first.clip(0, indices.shape[0] - 1)])
        out = jnp.where(empty, 0, out).astype(weight.dtype)
        max_indices = max_indices.astype(indices.dtype)
    else:
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.astype(compute)[:, None]
        rows = jnp.where(valid[:, None], rows, 0)
        out = jax.ops.segment_sum(rows, bag, bags + 1)[:bags]
        if mode == _MEAN:
            out = out / jnp.maximum(count, 1).astype(compute)[:, None]
        out = out.astype(weight.dtype)
    offset2bag = offset2bag.astype(indices.dtype)
    bag_size = jnp.zeros(offsets.shape, indices.dtype).at[:bags].set(count.astype(indices.dtype))
    return out, offset2bag, bag_size, max_indices


def _row_norms(magnitude, norm_type):
    """Each row's ``norm_type``-norm. The 1-, 2- and inf-norms as sums, a square root and a
    maximum, as ATen's ``norm`` computes them: ``x ** p`` with a float ``p`` is exp(p log x),
    whose error on a TPU (pow: 76 ulps from torch's; 4.4e-6 on the renormalised rows of
    tests/ops/test_embedding_bag.py on a v5e) ``x * x`` and ``sqrt`` (2 ulps) do not have."""
    if isinstance(norm_type, (int, float)):
        if math.isinf(norm_type):
            return jnp.max(magnitude, axis=1, initial=0)
        if norm_type == 1:
            return jnp.sum(magnitude, axis=1)
        if norm_type == 2:
            return jnp.sqrt(jnp.sum(magnitude * magnitude, axis=1))
    p = jnp.where(jnp.isinf(norm_type), 1.0, norm_type)
    return jnp.where(jnp.isinf(norm_type), jnp.max(magnitude, axis=1, initial=0),
                     jnp.sum(magnitude ** p, axis=1) ** (1 / p))


@lowers(aten.embedding_renorm.default)
def embedding_renorm(self, indices, max_norm, norm_type):
    """Rows named in ``indices`` whose ``norm_type``-norm exceeds ``max_norm`` are scaled by
    ``max_norm / (norm + 1e-7)`` (ATen's epsilon); the others are left as they are."""
    compute = opmath_dtype(self.dtype)
    rows = self.astype(compute)
    named = jnp.zeros((self.shape[0],), bool).at[indices.reshape(-1)].set(True)
    norm = _row_norms(jnp.abs(rows), norm_type)
    scale = jnp.where(named & (norm > max_norm), max_norm / (norm + 1e-7), 1)
    return (rows * scale[:, None].astype(compute)).astype(self.dtype)


@lowers(aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                 num_weights, scale_grad_by_freq, mode, per_sample_weights=None,
                                 padding_idx=-1):
    """The weight gradient ``(num_weights, D)``: each bag's gradient flows back to its rows
    (divided by the bag size for means, to the chosen row per feature for maxima)."""
    compute = opmath_dtype(grad.dtype)
    g = grad.astype(compute)
    out = jnp.zeros((num_weights, grad.shape[1]), compute)
    if mode == _MAX:
        # Empty bags chose no row.
        g = jnp.where((bag_size[:g.shape[0]] > 0)[:, None], g, 0)
        feature = jnp.broadcast_to(jnp.arange(g.shape[1]), g.shape)
        return out.at[maximum_indices, feature].add(g).astype(grad.dtype)
    rows = g[offset2bag]
    if mode == _MEAN:
        rows = rows / jnp.maximum(bag_size[offset2bag], 1).astype(compute)[:, None]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.astype(compute)[:, None]
    if scale_grad_by_freq:
        frequency = jnp.zeros((num_weights,), compute).at[indices].add(1)
        rows = rows / frequency[indices][:, None]
    if padding_idx >= 0:
        rows = jnp.where((indices != padding_idx)[:, None], rows, 0)
    return out.at[indices].add(rows).astype(grad.dtype)


@lowers(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode,
                                              padding_idx=-1):
    """``d/d per_sample_weights[i] = <grad[bag of i], weight[indices[i]]>`` (sum mode only);
    0 for padding rows."""
    compute = opmath_dtype(grad.dtype)
    rows = jnp.take(weight, indices, axis=0, mode="clip").astype(compute)
    out = jnp.sum(grad.astype(compute)[offset2bag] * rows, axis=1)
    if padding_idx >= 0:
        out = jnp.where(indices != padding_idx, out, 0)
    return out.astype(grad.dtype)


@lowers(aten._embedding_bag_backward.default)
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices,
                           num_weights, scale_grad_by_freq, mode, sparse,
                           per_sample_weights=None, padding_idx=-1):
    """The dense weight gradient (a ``sparse=True`` gradient is returned dense as well)."""
    return embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                        num_weights, scale_grad_by_freq, mode,
                                        per_sample_weights, padding_idx)
