"""The per-call op cache: repeated calls hit it, and nothing that changes a result is reused.

Oracle: the same ops in PyTorch on CPU. Each case runs a sequence on both devices that reuses one
op with arguments differing in exactly one respect (shape, strides, offset, a baked scalar, a
traced float, the storage, a 0-dim CPU tensor's value) and compares every result exactly.
"""

import os
import subprocess
import sys

import pytest
import torch

import tpu_train  # noqa: F401
from tpu_train.device import op_cache
from tests.device.test_aliasing import _base
from tests.tolerances import SAFETY, function_ulps, rounding_ulps, unit_roundoff

TPU = torch.device("tpu", 0)
F32 = torch.float32


def _same(tpu_results, cpu_results):
    assert len(tpu_results) == len(cpu_results)
    for a, b in zip(tpu_results, cpu_results):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)


def _run_both(case):
    _same(case(TPU), case(torch.device("cpu")))


def shapes_change(d):
    return [_base(d, (4, 6)) + 1, _base(d, (6, 4)) + 1, _base(d, (2, 3, 4)) + 1]


def strides_change(d):
    x = _base(d, (6, 6))
    return [x + 1, x.t() + 1, x[:, ::2].t() + 1]


def offsets_change(d):
    x = _base(d, (6, 6))
    return [x[1:3] + 1, x[2:4] + 1, x[4:6] + 1, x[:, 1] * 2, x[:, 4] * 2]


def baked_scalars_change(d):
    x = _base(d)
    i = _base(d, dtype=torch.int64)
    b = _base(d, dtype=torch.int64) % 2 == 0
    return [x + 2, x + 3, i * True, i * 1, b + True, b + 1, i + 1.5, i // 3, i // 4]


def traced_floats_change(d):
    x = _base(d)
    return [x * 0.5, x * 0.25, x.add(x, alpha=2.5), x.add(x, alpha=-1.0), x * -0.0, x * 0.0]


def host_scalar_changes(d):
    x = _base(d)
    return [x * torch.tensor(2.0), x * torch.tensor(3.0), x + torch.tensor(7)]


def inplace_same_geometry_other_storage(d):
    a, b = _base(d), _base(d) * 10
    a.add_(1)
    b.add_(1)
    a.mul_(0.5)
    b.mul_(0.25)
    return [a, b]


def inplace_views_other_offsets(d):
    x = _base(d, (4, 6))
    for row in range(4):
        x[row].add_(row * 100)
    x[:, 2].mul_(-1)
    x[:, 3].mul_(-1)
    return [x]


def out_argument_views(d):
    x, y = _base(d), _base(d) * 2
    z = torch.zeros(4, 12, device=d)
    torch.add(x, y, out=z[:, :6])
    torch.add(x, y, alpha=3, out=z[:, 6:])
    return [z]


def multiple_outputs(d):
    x = _base(d) % 5
    values, indices = torch.max(x, dim=1)
    values2, indices2 = torch.max(x.t(), dim=1)
    out_values, out_indices = torch.empty(4, device=d), torch.empty(4, dtype=torch.long, device=d)
    torch.max(x, 1, out=(out_values, out_indices))
    return [values, indices, values2, indices2, out_values, out_indices]


def copy_and_cast(d):
    x = _base(d)
    z = torch.zeros(6, 4, device=d)
    z.copy_(x.t())
    w = torch.zeros(4, 6, dtype=torch.int64, device=d)
    w[1:3].copy_(x[:2] * 1.5)
    return [z, w, x.to(torch.bfloat16), x.t().to(torch.int32), x.double()]


def data_dependent_shapes(d):
    out = []
    for threshold in (3, 11, 20):
        x = _base(d)
        out += [torch.nonzero(x > threshold), x[x > threshold],
                torch.masked_select(x.t(), x.t() < threshold)]
    return out


def geometry_changes_in_place(d):
    """The same tensor object keyed before and after its own geometry or storage changes (a
    tensor keeps its key part: each of these must renew it)."""
    out = []
    x = _base(d, (4, 6))
    out.append(x + 1)
    x.t_()
    out.append(x + 1)
    x.unsqueeze_(0)
    out.append(x * 2)
    x.as_strided_((3, 2), (1, 4), 2)
    out.append(x + 1)
    y = _base(d, (4, 6))
    out.append(y - 1)
    y.data = _base(d, (2, 3)) * 3
    out.append(y - 1)
    z = _base(d, (2, 3))
    out.append(z * 5)
    z.set_(_base(d, (2, 3)) + 100)
    out.append(z * 5)
    w = _base(d, (4, 6))
    out.append(w + 2)
    w.resize_(3, 5)
    out.append(w + 2)
    return out


CASES = [shapes_change, strides_change, offsets_change, baked_scalars_change,
         traced_floats_change, host_scalar_changes, inplace_same_geometry_other_storage,
         inplace_views_other_offsets, out_argument_views, multiple_outputs, copy_and_cast,
         data_dependent_shapes, geometry_changes_in_place]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_matches_cpu_twice(case):
    _run_both(case)
    _run_both(case)  # every key is cached now: the same answers from the entries


def test_a_stale_key_part_is_caught_by_the_self_check(monkeypatch):
    """The test session runs with TPU_TRAIN_VERIFY_KEY_PARTS=1: a tensor whose geometry changed
    behind the cache's back fails its next op instead of running the old geometry's program."""
    monkeypatch.setattr(op_cache, "_verify_key_parts", True)
    x = torch.arange(12.0).reshape(3, 4).to(TPU)
    x.key_part = ((4, 3),) + x.key_part[1:]
    with pytest.raises(RuntimeError, match="changed without refresh_key_part"):
        x + 1


def test_a_repeated_call_hits_the_cache():
    x, y = torch.randn(5, 7, device=TPU), torch.randn(5, 7, device=TPU)
    x + y
    x.add_(y)
    x.t()
    before = dict(op_cache._ENTRIES)
    for _ in range(3):
        z = x + y
        x.add_(y)
        v = x.t()
    assert op_cache._ENTRIES == before
    assert v._storage is x._storage
    torch.testing.assert_close(z.cpu(), x.cpu(), rtol=0, atol=0)  # z = x + y, then x += y


def test_a_new_float_value_does_not_compile_again():
    x = torch.randn(8, device=TPU)
    x.mul(0.5)
    keys = len(op_cache._ENTRIES)
    results = [x.mul(lr) for lr in (0.1, 0.2, 0.3)]
    assert len(op_cache._ENTRIES) == keys
    for lr, r in zip((0.1, 0.2, 0.3), results):
        torch.testing.assert_close(r.cpu(), x.cpu() * lr)


@pytest.mark.parametrize("draw", [
    lambda: torch.rand(64, device=TPU),
    lambda: torch.randn(64, device=TPU),
    lambda: torch.empty(64, device=TPU).uniform_(),
    lambda: torch.nn.functional.dropout(torch.ones(64, device=TPU), 0.5),
    lambda: torch.randint(0, 1000, (64,), device=TPU),
], ids=["rand", "randn", "uniform_", "dropout", "randint"])
def test_random_ops_draw_fresh_values_every_call(draw):
    torch.manual_seed(3)
    first, second, third = draw().cpu(), draw().cpu(), draw().cpu()
    assert not torch.equal(first, second) and not torch.equal(second, third)
    torch.manual_seed(3)
    assert torch.equal(draw().cpu(), first) and torch.equal(draw().cpu(), second)


def test_generator_draws_fresh_values_from_its_own_state():
    g = torch.Generator(device=TPU).manual_seed(5)
    a, b = torch.rand(16, device=TPU, generator=g), torch.rand(16, device=TPU, generator=g)
    assert not torch.equal(a.cpu(), b.cpu())
    g.manual_seed(5)
    assert torch.equal(torch.rand(16, device=TPU, generator=g).cpu(), a.cpu())


@pytest.mark.devices(2)
def test_errors_are_raised_on_every_call_not_cached():
    x = torch.ones(3, 4, device=TPU)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="broadcast"):
            x + torch.ones(5, device=TPU)
        with pytest.raises(RuntimeError, match="tpu:0 and tpu:1"):
            x + torch.ones(3, 4, device="tpu:1")
        with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
            x.add_(torch.ones(2, 3, 4, device=TPU))


def test_gradients_through_cached_ops_match_cpu():
    """Three steps of the same ops (run from the op cache from the second on), each step's
    gradient against PyTorch's on CPU from the same weights, and the update."""
    torch.manual_seed(0)
    w = torch.randn(6, 5).to(TPU).requires_grad_()
    for i in range(3):
        x = torch.arange(30.0).reshape(5, 6) / (i + 1)
        (torch.tanh(x.to(TPU) @ w) * 0.5).sum().backward()
        w_cpu = w.detach().cpu().requires_grad_()
        y = torch.tanh(x @ w_cpu)
        (y * 0.5).sum().backward()
        got, expected = w.grad.cpu(), w_cpu.grad
        bound = _tanh_gradient_bound(x, w_cpu.detach(), y.detach())
        excess = ((got - expected).double().abs() / bound).max().item()
        assert excess <= 1, f"step {i}: gradient difference {excess:.2f} x its bound"
        before = w.detach().cpu()
        with torch.no_grad():
            w.add_(w.grad, alpha=-0.1)
        w.grad = None
        # One multiply-add of float32 values: two roundings of the larger term each side.
        scale = (before.abs() + 0.1 * got.abs()).max().item()
        torch.testing.assert_close(w.detach().cpu(), torch.add(before, got, alpha=-0.1), rtol=0,
                                   atol=SAFETY * 2 * rounding_ulps(F32) * unit_roundoff(F32) * scale)


def _tanh_gradient_bound(x, w, y):
    """Elementwise bound on the difference of the gradient of sum(0.5 * tanh(x @ w)) w.r.t. w,
    x^T @ (0.5 * (1 - y^2)), between the test platform and PyTorch on CPU: the platform's tanh
    is within k u (1 + |y|) of torch's (k its measured ulps, tests/measured_ulps) and x @ w
    within 6 roundings of |x| @ |w| (reduction 6); 0.5 * (1 - y^2) moves by |y| times tanh's
    error and |y| (1 - y^2) times the matmul's, and x^T @ that sums them with |x| and adds
    its own 5 roundings (reduction 5). Roundings count rounding_ulps u each."""
    u, r = unit_roundoff(F32), rounding_ulps(F32)
    x, w, y = x.double().abs(), w.double().abs(), y.double()
    output_error = function_ulps("tanh") * u * (1 + y.abs()) + (1 - y ** 2) * 6 * r * u * (x @ w)
    return SAFETY * (x.T @ (y.abs() * output_error) + 5 * r * u * (x.T @ (0.5 * (1 - y ** 2))))


def test_memory_is_returned_when_outputs_die():
    x = torch.ones(1024, device=TPU)
    before = torch.tpu.memory_allocated(0)
    ys = [x * i for i in range(4)]
    assert torch.tpu.memory_allocated(0) == before + 4 * 4096
    del ys
    assert torch.tpu.memory_allocated(0) == before


def test_a_lowering_registered_later_is_used():
    from tpu_train.ops import registry

    library = torch.library.Library("tpu_train_test_cache", "DEF")
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
    op = torch.ops.tpu_train_test_cache.twice.default
    library.impl("twice", lambda x: torch.empty_like(x), "Meta")
    x = torch.arange(4.0, device=TPU)
    with pytest.raises(NotImplementedError, match="tpu_train_test_cache.twice"):
        op(x)
    registry.lowers(op)(lambda x: x * 2)
    torch.testing.assert_close(op(x).cpu(), torch.arange(4.0) * 2)


def test_sync_mode_runs_ops_and_waits():
    code = ("import torch, tpu_train\n"
            "from tpu_train.device import op_cache\n"
            "assert op_cache._sync\n"
            "x = torch.arange(6.0, device='tpu').reshape(2, 3)\n"
            "y = (x.t() * 2).sum(0); x.add_(1)\n"
            "print(y.cpu().tolist(), x.cpu().tolist())\n")
    env = dict(os.environ, TPU_TRAIN_SYNC="1", TPU_TRAIN_PLATFORM="cpu")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[6.0, 24.0] [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]"


def test_in_place_updates_never_invalidate_a_buffer_someone_else_holds():
    from tpu_train.device import storage_of

    x = torch.arange(8.0, device=TPU)
    for _ in range(2):
        x.mul_(2)  # cached from the second call on: the buffer is updated in place (donated)
    held = storage_of(x).buffer  # a second reference: the next update must copy
    view = x[2:6]
    x.mul_(2)
    x.add_(x)  # the same buffer twice in one call
    view.add_(1)
    assert held.tolist() == [i * 4.0 for i in range(8)]
    expected = torch.arange(8.0) * 16
    expected[2:6] += 1
    torch.testing.assert_close(x.cpu(), expected, rtol=0, atol=0)
    torch.testing.assert_close(view.cpu(), expected[2:6], rtol=0, atol=0)


def test_out_list_of_views_of_one_storage_keeps_every_write():
    """split_with_sizes_copy(out=[w[:4], w[4:]]) (what FSDP2 does with its all-gather output):
    both destinations are views of one storage, so their writes must chain, twice (the cached
    call too)."""
    for _ in range(2):
        expected = torch.zeros(8)
        torch.split_with_sizes_copy(torch.arange(8.0), [4, 4], out=[expected[:4], expected[4:]])
        got = torch.zeros(8, device="tpu")
        torch.split_with_sizes_copy(torch.arange(8.0, device="tpu"), [4, 4],
                                    out=[got[:4], got[4:]])
        assert torch.equal(got.cpu(), expected)
