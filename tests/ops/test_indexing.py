"""Indexing, gather and scatter lowerings against PyTorch on CPU, eagerly and under jax.jit."""

from __future__ import annotations

import jax
import pytest
import torch

import tpu_train.ops.indexing  # noqa: F401  (registers the lowerings)
from tests.ops.lowering_check import assert_lowering_matches, to_jax
from tests.tolerances import elementwise_rtol
from tests.ops.test_shape import assert_jitted_matches, check, make
from tpu_train.ops import registry

aten = torch.ops.aten


def idx(*values):
    return torch.tensor(values, dtype=torch.int64)


def eager_only(op, *args, **kwargs):
    """Data-dependent ops match eagerly and refuse, clearly, to be traced."""
    assert_lowering_matches(op, *args, **kwargs)
    with pytest.raises(NotImplementedError, match="concrete"):
        assert_jitted_matches(op, *args, **kwargs)


# --------------------------------------------------------------------------- index.Tensor


@pytest.mark.parametrize("group", [
    [aten.index.Tensor, aten.index.Tensor_hacked_twin, aten._unsafe_index.Tensor,
     aten._unsafe_index.Tensor_hacked_twin],
    [aten.index_put.default, aten.index_put.hacked_twin, aten._index_put_impl.default,
     aten._unsafe_index_put.default, aten._unsafe_index_put.hacked_twin],
], ids=lambda group: str(group[0]))
def test_variants_share_a_lowering(group):
    functions = {registry.get_lowering(op).fn for op in group}
    assert len(functions) == 1 and None not in functions


def test_index_put_impl_takes_unsafe():
    check(aten._index_put_impl.default, make((4, 3)), [idx(2, 0)], make((2, 3), seed=1), True,
          True)


X = make((4, 5, 6), torch.int64)


@pytest.mark.parametrize("indices", [
    [idx(0, 2, -1)],
    [None, idx(1, -2)],
    [idx(0, 1), idx(2, 3)],                           # adjacent: stay in place
    [idx(0, 1), None, idx(2, 3)],                     # separated: advanced dims go first
    [None, idx([0, 1], [2, 3]), idx(4)],              # broadcast index tensors
    [idx([[0], [3]]), idx([1, 2, 4])],
    [None, None, idx(5, 0, -6)],
    [idx(-1), None, idx([[1, 2]])],
    [idx()],                                          # empty index
])
def test_index_integer(indices):
    check(aten.index.Tensor, X, indices)


def test_index_bool_masks_are_eager():
    mask = torch.tensor([True, False, True, True])
    eager_only(aten.index.Tensor, X, [mask])
    eager_only(aten.index.Tensor, X, [None, torch.tensor([True, False, False, True, False])])
    eager_only(aten.index.Tensor, X, [make((4, 5), torch.bool)])
    eager_only(aten.index.Tensor, X, [mask, None, idx(1, 2, 3)])
    eager_only(aten.index.Tensor, X, [torch.zeros(4, dtype=torch.bool)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_index_dtypes(dtype):
    check(aten.index.Tensor, make((3, 4), dtype), [idx(2, 0), idx(-1, 1)])


# --------------------------------------------------------------------------- index_put


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("indices,values_shape", [
    ([idx(0, 2)], (2, 5, 6)),
    ([idx(0, 2)], (6,)),                               # values broadcast
    ([None, idx(1, 3)], (4, 2, 6)),
    ([idx(0, 1), None, idx(2, 3)], (2, 5)),           # separated advanced dims
    ([idx(-1), idx([0, 4])], (2, 6)),
    ([idx()], ()),
])
def test_index_put_integer(accumulate, indices, values_shape):
    values = make(values_shape, seed=1)
    check(aten.index_put.default, make((4, 5, 6)), indices, values, accumulate)


def test_index_put_accumulates_duplicates():
    check(aten.index_put.default, make((5,)), [idx(1, 1, 3, 1)], make((4,), seed=2), True)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("indices,values", [
    ([make((4, 5), torch.bool, seed=3)], torch.tensor(7.0)),
    ([make((4, 5), torch.bool, seed=3)], make((6,), seed=4)),      # one row for every hit
    ([make((4,), torch.bool, seed=3)], make((1, 5, 1), seed=4)),
    ([None, make((5,), torch.bool, seed=3)], make((4, 1, 6), seed=4)),
    ([None, make((5, 6), torch.bool, seed=3)], make((4, 1), seed=4)),
])
def test_index_put_shared_value_masks_compile(accumulate, indices, values):
    check(aten.index_put.default, make((4, 5, 6)), indices, values, accumulate)


def test_index_put_mask_with_one_value_per_hit_is_eager():
    mask = torch.tensor([True, False, True, False])
    eager_only(aten.index_put.default, make((4, 3)), [mask], make((2, 3), seed=1), False)
    eager_only(aten.index_put.default, make((4, 3)), [mask, idx(0, 2)], make((2,), seed=1),
               True)


def test_unsafe_masked_index_ops():
    x = make((4, 5))
    rows, cols = idx([0, 9, -3], [3, 2, -9]), idx([1, 4, -7])
    mask = torch.tensor([[True, False, True], [False, True, True]])
    check(aten._unsafe_masked_index.default, x, mask, [rows, cols], 0.5)
    check(aten._unsafe_masked_index.default, x, mask[..., None], [rows, None], -1.0)
    check(aten._unsafe_masked_index_put_accumulate.default, x, mask, [rows, cols],
          make((2, 3), seed=1))


# --------------------------------------------------------------------------- dim-wise indexing


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("index", [idx(2, 0, 2), idx(1), torch.tensor(1), idx()])
def test_index_select(dim, index):
    check(aten.index_select.default, make((3, 4, 5)), dim, index)


def test_index_select_scalar_self():
    check(aten.index_select.default, make(()), 0, idx(0))


@pytest.mark.parametrize("dim,index", [(0, idx(2, 0)), (1, idx(3, 3, 0)), (-1, idx()),
                                       (1, torch.tensor(2))])
def test_index_add_copy_fill(dim, index):
    x = make((3, 4, 5), torch.float32)
    source_shape = list(x.shape)
    source_shape[dim] = index.numel()
    source = make(tuple(source_shape), seed=1)
    # x + alpha * source, with up to two sources landing on one slot: four float32 roundings,
    # on values up to ~8 (standard normal inputs times alpha 2.5).
    rtol = elementwise_rtol(torch.float32, ulps=4)
    check(aten.index_add.default, x, dim, index, source, atol=8 * rtol, rtol=rtol)
    check(aten.index_add.default, x, dim, index, source, alpha=2.5, atol=8 * rtol, rtol=rtol)
    if index.numel() == len(set(index.reshape(-1).tolist())):
        check(aten.index_copy.default, x, dim, index, source)
    check(aten.index_fill.int_Scalar, x, dim, index, -3.5)
    check(aten.index_fill.int_Tensor, x, dim, index, torch.tensor(4.0))


def test_index_add_integers():
    check(aten.index_add.default, make((5, 2), torch.int64), 0, idx(4, 0, 4),
          make((3, 2), torch.int64, seed=1), alpha=3)


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(reduce, include_self):
    check(aten.index_reduce.default, make((4, 3)), 0, idx(1, 3, 1, 1), make((4, 3), seed=1),
          reduce, include_self=include_self, **_mean_tolerance(reduce, torch.float32))


def _mean_tolerance(reduce: str, dtype: torch.dtype) -> dict:
    """A float mean divides a sum by a count: one division, correctly rounded on the CPU
    client, a few u on a TPU (ELEMENTWISE_ULPS["arithmetic"]); values up to ~4 (standard normal
    sums of up to 4 terms). Every other reduction moves or compares values: exact."""
    if reduce != "mean" or not dtype.is_floating_point:
        return {}
    rtol = elementwise_rtol(dtype, ulps="arithmetic", roundings=2)
    return {"rtol": rtol, "atol": 4 * rtol}


# --------------------------------------------------------------------------- gather / scatter


def test_gather():
    x = make((3, 4, 5))
    check(aten.gather.default, x, 1, torch.randint(0, 4, (3, 6, 5)))
    check(aten.gather.default, x, 0, torch.randint(0, 3, (2, 2, 2)))   # smaller than self
    check(aten.gather.default, x, -1, torch.randint(0, 5, (3, 4, 1)))
    check(aten.gather.default, x, 2, torch.zeros((3, 0, 5), dtype=torch.int64))
    check(aten.gather.default, make(()), 0, torch.tensor(0))


def _unique_index(shape, high, dim, seed):
    """An index with distinct targets along ``dim`` (duplicate writes are unspecified)."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.rand((*shape[:dim], high, *shape[dim + 1:]), generator=generator)
    return noise.argsort(dim=dim).narrow(dim, 0, shape[dim])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter(dim):
    x = make((4, 5, 6))
    index = _unique_index((3, 4, 2), x.shape[dim], dim % 3, seed=dim)
    src = make((4, 5, 3), seed=1)                     # larger than index: only a block is used
    check(aten.scatter.src, x, dim, index, src)
    check(aten.scatter.value, x, dim, index, 2.5)
    check(aten.scatter.reduce, x, dim, index, src, reduce="add")
    check(aten.scatter.reduce, x, dim, index, src, reduce="multiply")
    check(aten.scatter.value_reduce, x, dim, index, 1.5, reduce="multiply")


def test_scatter_edge_cases():
    check(aten.scatter.src, make(()), 0, torch.tensor(0), make((), seed=1))
    check(aten.scatter.value, make((3, 2)), 0, torch.zeros((0, 2), dtype=torch.int64), 1.0)
    check(aten.scatter.src, make((3,), torch.int64), 0, idx(2, 0), make((2,), torch.int64, 1))


def test_scatter_add_with_duplicates():
    x = make((3, 5))
    index = torch.randint(0, 5, (3, 7), generator=torch.Generator().manual_seed(0))
    check(aten.scatter_add.default, x, 1, index, make((3, 7), seed=1))
    check(aten.scatter_add.default, x, 0, index[:, :4] % 3, make((3, 5), seed=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(dtype, reduce, include_self):
    x = make((4, 6), dtype)
    index = torch.randint(0, 6, (4, 5), generator=torch.Generator().manual_seed(3))
    src = make((4, 5), dtype, seed=1) if reduce != "prod" else make((4, 5), dtype, 1) % 4 + 1
    check(aten.scatter_reduce.two, x, 1, index, src, reduce, include_self=include_self,
          **_mean_tolerance(reduce, dtype))


# --------------------------------------------------------------------------- flat indexing


def test_take():
    check(aten.take.default, make((3, 4)), idx([0, -1], [11, -12]))
    check(aten.take.default, make((3, 4)), torch.tensor(5))
    check(aten.take.default, make((0,)), idx())


@pytest.mark.parametrize("accumulate", [False, True])
def test_put(accumulate):
    check(aten.put.default, make((3, 4)), idx([0, -1], [5, -12]), make((2, 2), seed=1),
          accumulate)
    check(aten.put.default, make((3, 4)), idx(), make((0,)), accumulate)


@pytest.mark.parametrize("self_shape,mask_shape", [((3, 4), (3, 4)), ((3, 4), (4,)),
                                                   ((4,), (3, 4)), ((2, 3), (2, 3))])
def test_masked_scatter(self_shape, mask_shape):
    mask = make(mask_shape, torch.bool, seed=5)
    check(aten.masked_scatter.default, make(self_shape), mask, make((20,), seed=1))
    check(aten.masked_scatter.default, make(self_shape, torch.int64), mask,
          make((3, 7), torch.int64, seed=1))


def test_masked_scatter_all_false_and_empty_source():
    check(aten.masked_scatter.default, make((2, 3)), torch.zeros(2, 3, dtype=torch.bool),
          make((0,)))


def test_masked_select_and_nonzero_are_eager():
    eager_only(aten.masked_select.default, make((3, 4)), make((3, 4), torch.bool, seed=2))
    eager_only(aten.masked_select.default, make((3, 4)), make((4,), torch.bool, seed=2))
    eager_only(aten.nonzero.default, make((3, 4), torch.bool, seed=2))
    eager_only(aten.nonzero.default, make((2, 3, 2), torch.int64))
    eager_only(aten.nonzero.default, torch.tensor(3.0))
    eager_only(aten.nonzero.default, torch.tensor(0.0))


@pytest.mark.parametrize("size,fill_value", [(3, -1), (20, -7), (0, -1)])
def test_nonzero_static(size, fill_value):
    check(aten.nonzero_static.default, make((3, 4), torch.bool, seed=2), size=size,
          fill_value=fill_value)


def test_integer_index_dtype_is_not_widened():
    """Index arithmetic stays in 32 bits: no s64 in the compiled program."""
    fn = registry.get_lowering(aten.index_put.default).fn
    program = jax.jit(lambda x, i, v: fn(x, [None, i], v, True)).lower(
        to_jax(make((4, 5))), to_jax(idx(1, -1)), to_jax(make((4, 2)))).as_text()
    assert "i64>" not in program.replace("array<i64", "")


def test_masked_scatter_backward():
    g = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([True, False, True, True])
    assert_lowering_matches(aten.masked_scatter_backward.default, g, mask, [4, 3], atol=0, rtol=0)
