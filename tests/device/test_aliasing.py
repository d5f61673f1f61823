"""Writes through views must be seen by the base and by sibling views, exactly as on CPU.

Each case builds tensors with the same values on CPU and on tpu, runs the same sequence of
view and mutation ops on both, and compares every tensor it returns (base and views) exactly.
"""

import pytest
import torch

import tpu_train
from tpu_train.device import lazy


def _base(device, shape=(4, 6), dtype=torch.float32):
    numel = 1
    for n in shape:
        numel *= n
    return torch.arange(numel, dtype=dtype).reshape(shape).to(device)


def slice_write(d):
    x = _base(d); v = x[1:3]; v.add_(100); return [x, v]
def slice_step_write(d):
    x = _base(d); v = x[:, ::2]; v.mul_(-1); return [x, v]
def select_write(d):
    x = _base(d); x[2].fill_(7); return [x]
def select_col_write(d):
    x = _base(d); c = x[:, 3]; c.sub_(1000); return [x, c]
def view_write(d):
    x = _base(d); v = x.view(24); v[5] = -5; return [x, v]
def reshape_view_write(d):
    x = _base(d); v = x.reshape(2, 12); v[1, 3:7] = 0; return [x, v]
def transpose_write(d):
    x = _base(d); t = x.t(); t[0].fill_(9); return [x, t]
def transpose_inplace_op(d):
    x = _base(d); t = x.transpose(0, 1); t.mul_(2); return [x, t]
def permute_write(d):
    x = _base(d, (2, 3, 4)); p = x.permute(2, 0, 1); p[1, 0].zero_(); return [x, p]
def expand_read_after_write(d):
    x = _base(d, (1, 6)); e = x.expand(4, 6); x.add_(1); return [x, e.clone()]
def narrow_write(d):
    x = _base(d); n = x.narrow(1, 2, 3); n.add_(0.5); return [x, n]
def diagonal_write(d):
    x = _base(d, (5, 5)); x.diagonal().fill_(-1); return [x]
def diagonal_offset_write(d):
    x = _base(d, (4, 6)); dg = x.diagonal(offset=2); dg.mul_(10); return [x, dg]
def unfold_read(d):
    x = _base(d, (10,)); u = x.unfold(0, 4, 2); return [u.clone()]
def unfold_write_nonoverlapping(d):
    x = _base(d, (12,)); u = x.unfold(0, 3, 3); u[1].fill_(0); return [x, u]
def as_strided_read(d):
    x = _base(d, (16,)); s = x.as_strided((3, 3), (4, 1), 2); return [s.clone()]
def as_strided_write(d):
    x = _base(d, (16,)); s = x.as_strided((2, 3), (5, 2), 1); s.fill_(-3); return [x]
def chained_views(d):
    x = _base(d, (4, 6, 2)); v = x[1:].transpose(0, 1)[2:, :, 1]; v.add_(1000); return [x, v]
def chained_views_write_base_then_read(d):
    x = _base(d, (4, 6)); v = x.t()[1:4, ::2]; x.mul_(3); return [v.clone(), x]
def sibling_views(d):
    x = _base(d); a = x[0:2]; b = x[1:3]; a.fill_(5); return [x, a, b]
def sibling_views_overlap_columns(d):
    x = _base(d); a = x[:, 1:4]; b = x[:, 3:]; b.mul_(-2); return [a, b, x]
def view_of_view_after_base_mutation(d):
    x = _base(d); v = x[1:]; w = v[:, 2:]; x.add_(1); return [v, w]
def view_of_view_after_view_mutation(d):
    x = _base(d); v = x[1:]; w = v[:, 2:]; w.zero_(); return [x, v, w]
def out_into_view(d):
    x = _base(d); y = torch.ones(2, 6, device=d); torch.add(y, y, out=x[2:]); return [x]
def out_into_transposed_view(d):
    x = _base(d, (3, 3)); y = torch.full((3, 3), 2.0, device=d); torch.mul(y, 3, out=x.t()); return [x]
def out_mm_into_slice(d):
    x = torch.zeros(4, 4, device=d); a = _base(d, (2, 3)); b = _base(d, (3, 4));
    torch.mm(a, b, out=x[1:3]); return [x]
def copy_into_view(d):
    x = _base(d); x[1:3, 2:4].copy_(torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]).to(d)); return [x]
def copy_from_cpu_into_view(d):
    x = _base(d); x[:, 0].copy_(torch.tensor([9.0, 8.0, 7.0, 6.0])); return [x]
def copy_broadcast_into_view(d):
    x = _base(d); x[1:3].copy_(torch.tensor([1.0, 2, 3, 4, 5, 6]).to(d)); return [x]
def copy_dtype_into_view(d):
    x = _base(d); x[0].copy_(torch.arange(6, dtype=torch.int64).to(d) * 7); return [x]
def index_put_through_view(d):
    x = _base(d); v = x[1:]; idx = torch.tensor([0, 2]).to(d);
    v.index_put_((idx,), torch.tensor(-9.0).to(d)); return [x, v]
def index_put_accumulate_through_view(d):
    x = _base(d); v = x[:, 1:]; idx = torch.tensor([1, 1, 3]).to(d);
    v.index_put_((idx,), torch.ones(3, 5).to(d), accumulate=True); return [x]
def setitem_tensor_index(d):
    x = _base(d); x[torch.tensor([0, 3]).to(d), 1:3] = 42.0; return [x]
def setitem_bool_mask(d):
    x = _base(d); x[x > 10] = 0.0; return [x]
def masked_fill_view(d):
    x = _base(d); v = x[:, ::3]; v.masked_fill_(v > 8, -1.0); return [x, v]
def inplace_chain_on_base_visible_in_views(d):
    x = _base(d); a = x[0]; b = x[:, 0]; x.add_(1).mul_(2); return [a, b]
def detach_shares_storage(d):
    x = _base(d); y = x.detach(); y.add_(1); return [x]
def squeeze_unsqueeze_write(d):
    x = _base(d, (1, 4, 1, 3)); v = x.squeeze().unsqueeze(0); v[0, 2].fill_(0); return [x]
def split_write(d):
    x = _base(d); parts = x.split(2, dim=1); parts[1].fill_(-7); return [x, *parts]
def chunk_write_unbind(d):
    x = _base(d); rows = x.unbind(0); rows[3].add_(100); return [x]
def view_dtype_int(d):
    x = _base(d, dtype=torch.int64); v = x[1:, 2:]; v.add_(5); return [x]
def bool_view_write(d):
    x = torch.zeros(4, 4, dtype=torch.bool).to(d); x[1:3, 1:3] = True; return [x]
def bf16_view_write(d):
    x = _base(d, dtype=torch.bfloat16); x[:, 1].mul_(0.5); return [x]
def zero_numel_view(d):
    x = _base(d); v = x[2:2]; v.fill_(1); return [x, v]
def clone_does_not_alias(d):
    x = _base(d); c = x[1:3].clone(); x.zero_(); return [c, x]
def contiguous_of_transpose_copies(d):
    x = _base(d); c = x.t().contiguous(); x.fill_(0); return [c]
def data_ptr_style_flat_param(d):
    flat = torch.zeros(10, device=d); w = flat[:6].view(2, 3); b = flat[6:];
    w.copy_(torch.ones(2, 3).to(d)); b.fill_(2); return [flat]
def grad_accumulation_through_view(d):
    buf = torch.zeros(8, device=d); g = buf[2:6].view(2, 2);
    g.add_(torch.ones(2, 2).to(d)); g.add_(torch.ones(2, 2).to(d)); return [buf]
def zero_through_expand_base(d):
    x = _base(d, (3,)); e = x.unsqueeze(0).expand(2, 3); x.zero_(); return [e.clone()]


CASES = [v for k, v in dict(globals()).items() if callable(v) and not k.startswith("_")
         and v.__module__ == __name__ and k not in ("pytest", "torch")]


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_matches_cpu(case, mode):
    expected = case("cpu")
    with tpu_train.eager_mode(mode):  # fused: the .cpu() reads below run the recorded region
        got = case("tpu")
        assert len(got) == len(expected)
        _assert_equal(got, expected)


def test_fused_mode_records_the_cases_ops():
    before = lazy.stats()["ops_recorded"]
    with tpu_train.eager_mode("fused"):
        got = [t for case in CASES for t in case("tpu")]
        assert lazy.stats()["ops_recorded"] - before >= len(CASES)
    _assert_equal(got, [t for case in CASES for t in case("cpu")])


def _assert_equal(got, expected):
    for g, e in zip(got, expected):
        assert g.device.type == "tpu"
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g.cpu(), e, rtol=0, atol=0)


def test_inplace_view_ops_change_the_tensor_itself():
    for device in ("cpu", "tpu"):
        x = _base(device, (1, 6))
        y = x.squeeze_(0)
        assert y is x and x.shape == (6,)
        t = _base(device, (3, 4)).transpose_(0, 1)
        assert t.shape == (4, 3) and t.stride() == (1, 4)
        t[0].fill_(-1)
    torch.testing.assert_close(t.cpu(), _base("cpu", (3, 4)).transpose_(0, 1).index_fill_(0, torch.tensor([0]), -1))


def test_one_dim_matmul_squeezes_like_cpu():
    a, b = torch.randn(5), torch.randn(5, 3)
    got = a.to("tpu") @ b.to("tpu")
    assert got.shape == (3,)
    torch.testing.assert_close(got.cpu(), a @ b)


def test_tensor_constructor_on_device_and_boolean_masks():
    assert torch.equal(torch.tensor([1.0, 2.0], device="tpu").cpu(), torch.tensor([1.0, 2.0]))
    x = torch.randn(4, 5)
    t = x.to("tpu")
    assert torch.equal(t[t > 0].cpu(), x[x > 0])
    assert torch.equal(torch.nonzero(t).cpu(), torch.nonzero(x))


def test_setting_param_data_to_a_view_shares_its_storage():
    flat = torch.arange(6.0).to("tpu")
    param = torch.nn.Parameter(torch.ones(3).to("tpu"))
    param.data = flat[3:]
    flat.add_(10)
    assert isinstance(param, torch.nn.Parameter)
    assert torch.equal(param.detach().cpu(), torch.tensor([13.0, 14.0, 15.0]))
