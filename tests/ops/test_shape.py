"""View, split, join and tiling lowerings against PyTorch on CPU, eagerly and under jax.jit."""

from __future__ import annotations

import jax
import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import tpu_train.ops.scatter  # noqa: F401  (registers the lowerings)
import tpu_train.ops.shape  # noqa: F401
from tests.ops.lowering_check import assert_lowering_matches, to_jax, to_torch
from tpu_train.ops import registry

aten = torch.ops.aten

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def make(shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-50, 50, shape, generator=generator).to(dtype)


def assert_jitted_matches(op, *args, atol=0.0, rtol=0.0, **kwargs):
    """The lowering traced once by ``jax.jit`` (tensors as traced arguments) matches torch.

    This is how the compiled step runs it: any branch on array values fails here.
    """
    expected = op(*args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    tensor_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    fn = registry.get_lowering(op).fn

    def traced(*arrays):
        filled = list(leaves)
        for slot, array in zip(tensor_slots, arrays):
            filled[slot] = array
        call_args, call_kwargs = tree_unflatten(filled, spec)
        return fn(*call_args, **call_kwargs)

    got = jax.jit(traced)(*[to_jax(leaves[i]) for i in tensor_slots])
    expected_list = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    got_list = [got] if isinstance(expected, torch.Tensor) else list(got)
    assert len(got_list) == len(expected_list)
    for g, e in zip(got_list, expected_list):
        g = to_torch(g, e.dtype)
        assert g.shape == e.shape, f"{op}: shape {tuple(g.shape)} != torch's {tuple(e.shape)}"
        # View, split, join and tiling ops only move values (no arithmetic): exact, unless the
        # caller names the tolerance of the arithmetic its op does.
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol, equal_nan=True)


def check(op, *args, atol=None, rtol=None, **kwargs):
    """Eager lowering and jitted trace against torch; data movement is exact, ops with
    arithmetic pass ``atol``/``rtol``."""
    assert_lowering_matches(op, *args, atol=atol, rtol=rtol, **kwargs)
    assert_jitted_matches(op, *args, atol=atol or 0.0, rtol=rtol or 0.0, **kwargs)


# --------------------------------------------------------------------------- shared lowerings

# Ops whose values are the same function of their arguments: the first of each group is
# checked against torch below, the others must share its lowering.
SHARED = [
    [aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default],
    [aten._reshape_alias.default, aten._reshape_alias_copy.default],
    [aten.view.dtype, aten.view_copy.dtype],
    [aten.alias.default, aten.detach.default, aten.lift_fresh.default,
     aten.lift_fresh_copy.default, aten.alias_copy.default, aten.detach_copy.default],
    [aten.expand.default, aten.expand_copy.default],
    [aten.permute.default, aten.permute_copy.default],
    [aten.transpose.int, aten.transpose_copy.int, aten.swapaxes.default],
    [aten.t.default, aten.t_copy.default],
    [aten.movedim.int, aten.movedim.intlist, aten.moveaxis.int, aten.moveaxis.intlist],
    [aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze_copy.default,
     aten.squeeze_copy.dim, aten.squeeze_copy.dims],
    [aten.unsqueeze.default, aten.unsqueeze_copy.default],
    [aten.slice.Tensor, aten.slice_copy.Tensor],
    [aten.narrow.default, aten.narrow_copy.default],
    [aten.select.int, aten.select_copy.int],
    [aten.diagonal.default, aten.diagonal_copy.default],
    [aten.unfold.default, aten.unfold_copy.default],
    [aten.as_strided.default, aten.as_strided_copy.default],
    [aten.split.Tensor, aten.split_copy.Tensor, aten.unsafe_split.Tensor],
    [aten.split_with_sizes.default, aten.split_with_sizes_copy.default, aten.split.sizes,
     aten.unsafe_split_with_sizes.default],
    [aten.chunk.default, aten.unsafe_chunk.default],
    [aten.unbind.int, aten.unbind_copy.int],
    [aten.view_as_real.default, aten.view_as_real_copy.default],
    [aten.view_as_complex.default, aten.view_as_complex_copy.default],
    [aten.cat.default, aten.concat.default, aten.concatenate.default],
]


@pytest.mark.parametrize("group", SHARED, ids=lambda group: str(group[0]))
def test_variants_share_a_lowering(group):
    functions = {registry.get_lowering(op).fn for op in group}
    assert len(functions) == 1 and None not in functions


# --------------------------------------------------------------------------- reshapes / aliases


@pytest.mark.parametrize("dtype", DTYPES)
def test_view_reshapes(dtype):
    op = aten.view.default
    x = make((2, 3, 4), dtype)
    check(op, x, [6, 4])
    check(op, x, [-1, 2])
    check(op, x, [24])
    check(op, make((), dtype), [1, 1])
    check(op, make((0, 3), dtype), [3, 0, 5])
    check(op, make((0, 3), dtype), [-1, 3])


def test_reshape_alias_ignores_strides():
    x = make((2, 6))
    check(aten._reshape_alias.default, x, [3, 4], [4, 1])
    check(aten._reshape_alias_copy.default, x, [12], [1])


@pytest.mark.parametrize("source,target", [(torch.float32, torch.int32),
                                           (torch.int32, torch.float32),
                                           (torch.float32, torch.bfloat16),
                                           (torch.bfloat16, torch.float32),
                                           (torch.float16, torch.bfloat16)])
def test_view_dtype_reinterprets_bits(source, target):
    check(aten.view.dtype, make((3, 4), source), target)


def test_aliases_keep_the_value():
    op = aten.alias.default
    check(op, make((3, 2)))
    check(op, make((), torch.int64))


def test_expand():
    op = aten.expand.default
    check(op, make((3, 1)), [2, 3, 4])
    check(op, make((3, 1)), [-1, 5])
    check(op, make((1,), torch.bool), [0])
    check(op, make(()), [2, 2])
    check(op, make((2, 1, 3)), [4, -1, -1, 3])


# --------------------------------------------------------------------------- permutations


def test_permute():
    op = aten.permute.default
    x = make((2, 3, 4), torch.int64)
    check(op, x, [2, 0, 1])
    check(op, x, [-1, -3, 1])
    check(op, make(()), [])


def test_transpose():
    op = aten.transpose.int
    check(op, make((2, 3, 4)), 0, 2)
    check(op, make((2, 3, 4)), -1, 1)
    check(op, make((5,)), 0, -1)
    check(op, make(()), 0, -1)


@pytest.mark.parametrize("shape", [(), (4,), (2, 3), (0, 3)])
def test_t(shape):
    check(aten.t.default, make(shape))


@pytest.mark.parametrize("source,destination", [(0, 2), (-1, 0), ([0, 1], [2, 0]),
                                                ([2, 0], [0, 1]), ([], [])])
def test_movedim(source, destination):
    op = aten.movedim.int if isinstance(source, int) else aten.movedim.intlist
    check(op, make((2, 3, 4)), source, destination)


# --------------------------------------------------------------------------- squeeze


@pytest.mark.parametrize("shape", [(1, 3, 1, 2), (), (1,), (0, 1)])
def test_squeeze_all(shape):
    check(aten.squeeze.default, make(shape))


@pytest.mark.parametrize("dim", [0, 1, -1, -2])
def test_squeeze_dim(dim):
    check(aten.squeeze.dim, make((1, 3, 1, 2)), dim)
    check(aten.squeeze_copy.dim, make((2, 1)), dim)


def test_squeeze_edge_dims():
    check(aten.squeeze.dim, make(()), 0)
    check(aten.squeeze.dim, make(()), -1)
    check(aten.squeeze.dims, make((1, 3, 1, 2)), [0, -2, 1])
    check(aten.squeeze.dims, make((1, 3, 1)), [])
    check(aten.squeeze_copy.dims, make(()), [0])


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
def test_unsqueeze(dim):
    check(aten.unsqueeze.default, make((2, 3), torch.bool), dim)
    check(aten.unsqueeze_copy.default, make((2, 3)), dim)


def test_unsqueeze_scalar():
    check(aten.unsqueeze.default, make(()), 0)
    check(aten.unsqueeze.default, make(()), -1)


# --------------------------------------------------------------------------- slicing


@pytest.mark.parametrize("bounds", [(None, None, 1), (1, 4, 1), (-3, None, 1), (None, -1, 2),
                                    (2, 100, 3), (-100, 3, 1), (5, 2, 1), (7, 9, 1),
                                    (0, 9223372036854775807, 1), (3, 3, 2)])
def test_slice(bounds):
    op = aten.slice.Tensor
    start, end, step = bounds
    x = make((4, 7), torch.int64)
    check(op, x, 1, start, end, step)
    check(op, x, -2, start, end, step)


def test_slice_defaults_and_empty():
    check(aten.slice.Tensor, make((5, 2)))
    check(aten.slice.Tensor, make((0, 2)), 0, 1, 3)


def test_narrow():
    op = aten.narrow.default
    x = make((5, 6))
    check(op, x, 1, 2, 3)
    check(op, x, 0, -2, 2)
    check(op, x, -1, 6, 0)


def test_narrow_from_a_tensor_start():
    x = make((5, 6))
    check(aten.narrow.Tensor, x, 1, torch.tensor(2), 3)
    check(aten.narrow.Tensor, x, 0, torch.tensor(-2), 2)
    check(aten.narrow.Tensor, x, -1, torch.tensor(6), 0)


@pytest.mark.parametrize("dim,index", [(0, 0), (1, 2), (-1, -1), (2, 3), (-3, -2)])
def test_select(dim, index):
    check(aten.select.int, make((3, 4, 5), torch.bfloat16), dim, index)


def test_select_rejects_out_of_range():
    with pytest.raises(IndexError):
        registry.get_lowering(aten.select.int).fn(to_jax(make((3,))), 0, 3)


@pytest.mark.parametrize("shape,offset,dim1,dim2", [
    ((4, 4), 0, 0, 1), ((3, 5), 1, 0, 1), ((3, 5), -2, 0, 1), ((5, 3), 2, 1, 0),
    ((2, 3, 4), 0, 1, 2), ((2, 3, 4), -1, 2, 0), ((2, 3, 4, 5), 1, -1, 1),
    ((3, 3), 3, 0, 1), ((3, 3), -5, 0, 1), ((0, 4), 0, 0, 1), ((1, 1), 0, 0, 1)])
def test_diagonal(shape, offset, dim1, dim2):
    check(aten.diagonal.default, make(shape), offset, dim1, dim2)


@pytest.mark.parametrize("shape,dim,size,step", [
    ((10,), 0, 3, 1), ((10,), 0, 3, 3), ((10,), 0, 4, 3), ((2, 9, 3), 1, 2, 4),
    ((2, 9, 3), -1, 3, 1), ((8, 2), 0, 8, 1), ((6,), 0, 0, 1), ((2, 40), 1, 35, 2),
    ((), 0, 1, 1), ((), -1, 0, 2), ((0, 3), 1, 2, 1)])
def test_unfold(shape, dim, size, step):
    check(aten.unfold.default, make(shape), dim, size, step)


# --------------------------------------------------------------------------- as_strided


@pytest.mark.parametrize("source,size,stride,offset", [
    ((4, 6), (4, 6), (6, 1), 0),          # identity
    ((4, 6), (6, 4), (1, 6), 0),          # transpose
    ((4, 6), (2, 3), (6, 1), 7),          # window with offset
    ((4, 6), (2, 3), (12, 2), 1),         # strided rows and columns
    ((24,), (2, 3, 4), (12, 4, 1), 0),    # contiguous reshape
    ((24,), (3, 2, 2), (1, 12, 4), 0),    # permuted dims
    ((4, 6), (3, 4), (0, 1), 2),          # broadcast dim
    ((4, 6), (2, 1, 3), (6, 100, 2), 3),  # size-1 dim with any stride
    ((4, 6), (4,), (7, ), 0),             # diagonal
    ((2, 4, 6), (2, 4), (24, 7), 1),      # batched diagonal
    ((16,), (3, 3), (4, 3), 0),           # strides that do not divide
    ((10,), (4, 3), (2, 1), 0),           # overlapping windows: gather
    ((12,), (3, 3), (3, 2), 0),           # overlapping, irregular: gather
    ((10,), (2, 0), (1, 1), 4),           # empty view
    ((3, 3), (), (), 4),                  # 0-dim view
    ((5,), (5,), (1,), None),             # default offset
    ((2, 3), (3,), (2,), 0),              # reaches the last element
])
def test_as_strided(source, size, stride, offset):
    x = make(source, torch.int64)
    check(aten.as_strided.default, x, list(size), list(stride), offset)


def test_as_strided_rejects_out_of_bounds():
    with pytest.raises(RuntimeError, match="out of bounds"):
        registry.get_lowering(aten.as_strided.default).fn(to_jax(make((5,))), [3], [3], 0)


# --------------------------------------------------------------------------- splits


@pytest.mark.parametrize("shape,split_size,dim", [((7, 3), 2, 0), ((7, 3), 3, -1),
                                                  ((7, 3), 10, 0), ((0, 3), 0, 0),
                                                  ((0, 3), 2, 0), ((4,), 1, 0)])
def test_split(shape, split_size, dim):
    check(aten.split.Tensor, make(shape), split_size, dim)


def test_split_with_sizes():
    op = aten.split_with_sizes.default
    x = make((3, 9), torch.int64)
    check(op, x, [2, 0, 7], 1)
    check(op, x, [1, 2], 0)
    check(op, x, [9], -1)


@pytest.mark.parametrize("length,chunks", [(10, 3), (10, 4), (3, 5), (6, 6), (0, 2), (1, 1)])
def test_chunk(length, chunks):
    check(aten.chunk.default, make((2, length)), chunks, 1)


def test_unbind():
    op = aten.unbind.int
    check(op, make((3, 4)), 0)
    check(op, make((3, 4)), -1)
    check(op, make((0, 4)), 0)


# --------------------------------------------------------------------------- complex views


def test_view_as_real_and_complex():
    z = torch.complex(make((3, 2)), make((3, 2), seed=1))
    check(aten.view_as_real.default, z)
    check(aten.view_as_real_copy.default, z)
    check(aten.view_as_complex.default, make((4, 2)))
    check(aten.view_as_complex_copy.default, make((2,)))


# --------------------------------------------------------------------------- joins and tiling


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat(dim):
    parts = [make((2, 3), torch.float32), make((2, 3), torch.float32, seed=1)]
    check(aten.cat.default, parts, dim)
    check(aten.concat.default, parts, dim)


def test_cat_skips_legacy_empty_and_promotes():
    check(aten.cat.default, [make((0,)), make((2, 3)), make((0,)), make((1, 3))], 0)
    check(aten.cat.default, [make((0,)), make((0,))], 0)
    check(aten.cat.default, [make((2,), torch.int64), make((3,), torch.float32)], 0)
    check(aten.cat.default, [make((2,), torch.bool), make((1,), torch.int64)], -1)
    check(aten.cat.default, [make((2, 0)), make((2, 3))], 1)
    check(aten.cat.default, [make((4,))], 0)


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_stack(dim):
    check(aten.stack.default, [make((2, 3)), make((2, 3), seed=1), make((2, 3), seed=2)], dim)


def test_stack_scalars_and_mixed_dtypes():
    check(aten.stack.default, [make(()), make((), seed=1)], 0)
    check(aten.stack.default, [make((2,), torch.int64), make((2,), torch.bfloat16)], -1)


@pytest.mark.parametrize("dims", [[0], [1, 2], [-1], [0, 1, 2], []])
def test_flip(dims):
    check(aten.flip.default, make((2, 3, 4), torch.int64), dims)


def test_flip_scalar():
    check(aten.flip.default, make(()), [0])


@pytest.mark.parametrize("shifts,dims", [([1], [0]), ([-2], [1]), ([7], [-1]), ([2, -1], [0, 1]),
                                         ([3], []), ([-11], []), ([0], [0]), ([1, 1], [1, 1])])
def test_roll(shifts, dims):
    check(aten.roll.default, make((3, 4)), shifts, dims)


def test_roll_empty():
    check(aten.roll.default, make((0, 4)), [2], [0])


@pytest.mark.parametrize("shape,repeats", [((2, 3), [2, 1]), ((2, 3), [1, 2, 3]), ((3,), [0, 2]),
                                           ((), [2, 3]), ((), []), ((2, 1), [1, 4])])
def test_repeat(shape, repeats):
    check(aten.repeat.default, make(shape, torch.int64), repeats)


@pytest.mark.parametrize("shape,dims", [((2, 3), [2]), ((2, 3), [2, 2]), ((3,), [2, 1, 2])])
def test_tile(shape, dims):
    check(aten.tile.default, make(shape), dims)


@pytest.mark.parametrize("op", [aten.tril.default, aten.triu.default])
@pytest.mark.parametrize("diagonal", [0, 1, -1, 5, -5])
def test_triangles(op, diagonal):
    check(op, make((4, 5)), diagonal)
    check(op, make((2, 3, 3), torch.int64), diagonal)
    check(op, make((3, 2), torch.bool), diagonal)


# --------------------------------------------------------------------------- XLA-friendly forms


def _stablehlo(op, *args):
    fn = registry.get_lowering(op).fn
    return jax.jit(lambda x: fn(x, *args)).lower(to_jax(make((4, 6, 8)))).as_text()


@pytest.mark.parametrize("op,args", [
    (aten.as_strided.default, ([8, 6, 4], [1, 8, 48], 0)),   # a permutation
    (aten.as_strided.default, ([2, 3, 4], [48, 8, 2], 9)),    # a strided window
    (aten.as_strided.default, ([4, 4], [48, 9], 0)),          # a batch of diagonals
    (aten.as_strided.default, ([3, 5], [16, 3], 2)),          # strides that do not divide
    (aten.as_strided.default, ([4, 3, 8], [48, 0, 1], 0)),    # a broadcast
    (aten.diagonal.default, (1, 1, 2)),
    (aten.slice.Tensor, (2, 1, 7, 3)),
    (aten.select.int, (1, -1)),
    (aten.unfold.default, (2, 3, 2)),
    (aten.split_with_sizes.default, ([1, 3], 0)),
    (aten.roll.default, ([3], [2])),
    (aten.repeat.default, ([2, 1, 1, 3],)),
])
def test_views_never_gather(op, args):
    """Views whose geometry is a slice, transpose or broadcast must not become gathers."""
    program = _stablehlo(op, *args)
    assert "gather" not in program and "dynamic_slice" not in program


def test_overlapping_as_strided_gathers():
    assert "gather" in _stablehlo(aten.as_strided.default, [5, 4], [2, 1], 0)


# --------------------------------------------------------------------------- view scatters


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
@pytest.mark.parametrize("dim,start,end,step", [
    (0, None, None, 1), (1, 1, 4, 1), (1, -3, None, 1), (1, None, -1, 2), (0, 1, 100, 3),
    (1, 2, 2, 1), (-1, 0, 7, 4), (1, 6, None, 5)])
def test_slice_scatter(dtype, dim, start, end, step):
    base = make((5, 7), dtype)
    view = aten.slice.Tensor(base, dim, start, end, step)
    check(aten.slice_scatter.default, base, make(tuple(view.shape), dtype, seed=1), dim, start,
          end, step)


def test_slice_scatter_casts_src_to_base_dtype():
    check(aten.slice_scatter.default, make((4, 3)), make((2, 3), torch.int64), 0, 1, 3)


@pytest.mark.parametrize("dim,start,end,step", [
    (0, 0, 5, 1), (1, 1, 4, 1), (1, -3, 2**63 - 1, 1), (1, 0, -1, 2), (0, 1, 100, 3),
    (1, 2, 2, 1), (-1, 0, 7, 4), (1, 6, 7, 5)])
def test_slice_backward(dim, start, end, step):
    """The gradient of a slice: RoPE's halves and ``x[:, 1:]`` in every transformers model."""
    view = aten.slice.Tensor(make((5, 7)), dim, start, end, step)
    check(aten.slice_backward.default, make(tuple(view.shape), seed=1), [5, 7], dim, start,
          end, step)


@pytest.mark.parametrize("dim,index", [(0, 0), (1, -1), (-1, 2), (2, 0)])
def test_select_scatter(dim, index):
    base = make((3, 4, 5))
    view = aten.select.int(base, dim, index)
    check(aten.select_scatter.default, base, make(tuple(view.shape), seed=1), dim, index)


def test_select_scatter_1d():
    check(aten.select_scatter.default, make((4,), torch.int64), make((), torch.int64, seed=3),
          0, -2)


@pytest.mark.parametrize("shape,offset,dim1,dim2", [
    ((4, 4), 0, 0, 1), ((3, 5), 2, 0, 1), ((3, 5), -1, 0, 1), ((5, 3), 1, 1, 0),
    ((2, 3, 4), 0, 1, 2), ((2, 3, 4), -1, 2, 0), ((3, 3), 4, 0, 1), ((2, 3, 4, 5), 1, -1, 1)])
def test_diagonal_scatter(shape, offset, dim1, dim2):
    base = make(shape, torch.int64)
    view = aten.diagonal.default(base, offset, dim1, dim2)
    check(aten.diagonal_scatter.default, base, make(tuple(view.shape), torch.int64, seed=1),
          offset, dim1, dim2)


@pytest.mark.parametrize("source,size,stride,offset", [
    ((4, 6), (4, 6), (6, 1), 0),
    ((4, 6), (6, 4), (1, 6), 0),
    ((4, 6), (2, 3), (12, 2), 1),
    ((4, 6), (4,), (7,), 0),
    ((2, 4, 6), (2, 4), (24, 7), 1),
    ((16,), (3, 3), (4, 3), 0),
    ((4, 6), (2, 1, 3), (6, 100, 2), 3),
    ((2, 3), (3,), (2,), 0),
    ((3, 3), (), (), 4),
    ((10,), (2, 0), (1, 1), 4),
    ((10,), (4, 2), (2, 1), 0),            # overlapping: the later write wins in both
])
def test_as_strided_scatter(source, size, stride, offset):
    base = make(source, torch.int64)
    src = make(size, torch.int64, seed=1)
    if size == (4, 2):
        # Overlapping writes must agree for the result to be defined.
        src = torch.arange(10)[torch.arange(4)[:, None] * 2 + torch.arange(2)]
    check(aten.as_strided_scatter.default, base, src, list(size), list(stride), offset)


@pytest.mark.parametrize("op,args", [
    (aten.slice_scatter.default, ((4, 3, 8), 1, 1, 4, 1)),
    (aten.slice_scatter.default, ((4, 3, 8), 1, 1, None, 2)),
    (aten.select_scatter.default, ((4, 8), 1, 2)),
    (aten.diagonal_scatter.default, ((4, 6), 1, 1, 2)),
    (aten.as_strided_scatter.default, ((3, 4, 2), [3, 4, 2], [16, 2, 1], 5)),
    (aten.as_strided_scatter.default, ((4, 6), [4, 6], [1, 4], 0)),
])
def test_view_scatters_never_scatter(op, args):
    """Writes through regular views are slices, pads and selects, not generic scatters."""
    src_shape, *rest = args
    fn = registry.get_lowering(op).fn
    program = jax.jit(lambda x, src: fn(x, src, *rest)).lower(
        to_jax(make((4, 6, 8))), to_jax(make(src_shape))).as_text()
    assert "scatter" not in program and "gather" not in program
