"""Runtime, registration and device placement: torch.tpu behaves like torch.cuda."""

import copy
import os
import subprocess
import sys

import jax
import pytest
import torch

import tpu_train


@pytest.mark.devices(8)
def test_device_count_is_eight_virtual_devices():
    assert torch.tpu.device_count() == 8
    assert tpu_train.runtime_info()["device_count"] == 8
    assert torch.tpu.is_available()


@pytest.mark.devices(8)
@pytest.mark.parametrize("index", [0, 3, 7])
def test_tensors_land_on_the_device_asked_for(index):
    x = torch.arange(6.0).to(f"tpu:{index}")
    assert x.device == torch.device("tpu", index)
    assert x._storage.buffer.devices() == {jax.devices("cpu")[index]}
    y = (x * 2).sum()
    assert y.device == torch.device("tpu", index)
    z = torch.zeros(3, device=tpu_train.device(index))
    assert z.device.index == index


@pytest.mark.devices(8)
def test_move_between_devices():
    x = torch.arange(4.0, device="tpu:1")
    y = x.to("tpu:5")
    assert y.device.index == 5
    assert torch.equal(y.cpu(), torch.arange(4.0))


@pytest.mark.devices(8)
def test_device_index_out_of_range_is_a_clear_error():
    with pytest.raises(IndexError, match=r"tpu device index 8 is out of range.*tpu:0\.\.tpu:7"):
        tpu_train.device(8)
    with pytest.raises(IndexError, match="out of range"):
        torch.empty(2, device="tpu:12")


def test_mixing_tpu_and_cpu_tensors_names_both_devices():
    with pytest.raises(RuntimeError, match=r"tpu:0 and cpu"):
        torch.ones(2, 2, device="tpu") + torch.ones(2, 2)


@pytest.mark.devices(8)
def test_mixing_two_tpu_devices_names_both():
    with pytest.raises(RuntimeError, match=r"tpu:0 and tpu:2"):
        torch.ones(2, device="tpu:0") + torch.ones(2, device="tpu:2")


def test_zero_dim_cpu_tensor_is_allowed_like_on_cuda():
    x = torch.ones(3, device="tpu") * torch.tensor(2.0)
    assert x.device.type == "tpu" and torch.equal(x.cpu(), torch.full((3,), 2.0))


def test_unknown_platform_is_a_clear_error():
    env = dict(os.environ, TPU_TRAIN_PLATFORM="abacus")
    result = subprocess.run([sys.executable, "-c", "import tpu_train; tpu_train.device(0)"],
                            env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "TPU_TRAIN_PLATFORM='abacus' is not a known platform" in result.stderr
    assert "tpu, cuda, cpu" in result.stderr


@pytest.mark.host_without_chips
def test_unavailable_platform_is_a_clear_error():
    env = dict(os.environ, TPU_TRAIN_PLATFORM="tpu")
    result = subprocess.run([sys.executable, "-c", "import torch, tpu_train; torch.zeros(1, device='tpu')"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "JAX finds no tpu devices" in result.stderr


def test_tensor_methods_and_module_methods():
    x = torch.ones(2).tpu()
    assert x.is_tpu and x.device.type == "tpu"
    module = torch.nn.Linear(2, 2).tpu()
    assert module.weight.device.type == "tpu"
    assert isinstance(module.weight, torch.nn.Parameter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int8, torch.int16, torch.int32, torch.int64,
                                   torch.uint8, torch.bool])
def test_dtype_round_trip(dtype):
    source = (torch.arange(-6, 6) % 5).to(dtype)
    x = source.to("tpu")
    assert x.dtype == dtype
    back = x.cpu()
    assert back.dtype == dtype and torch.equal(back, source)


def test_int64_stays_int64_as_torch_sees_it():
    x = torch.arange(5, device="tpu")
    assert x.dtype == torch.int64
    assert (x + 1).dtype == torch.int64
    assert x.sum().dtype == torch.int64
    assert x.sum().item() == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int32, torch.int8, torch.bool, torch.complex64])
def test_item_of_a_one_element_storage_is_the_python_number_cpu_gives(dtype):
    """A scalar that is its whole storage (a compiled step's loss) is read from its buffer's
    host copy directly; a scalar viewing a larger storage the general way. Both give exactly
    what the same tensor on the CPU gives, of the same Python type."""
    source = (torch.arange(-3, 3) * 7 % 5).to(dtype) / (3 if dtype.is_floating_point else 1)
    x = source.to("tpu")
    for cpu_value, tpu_value in ((source[4], x[4]), (source[4].clone(), x[4].clone()),
                                 (source.sum(), x.sum())):
        expected, got = cpu_value.item(), tpu_value.item()
        assert type(got) is type(expected) and got == expected, (dtype, got, expected)
        assert float(tpu_value.real if dtype.is_complex else tpu_value) == float(
            cpu_value.real if dtype.is_complex else cpu_value)


@pytest.mark.devices(8)
def test_save_load_round_trip(tmp_path):
    x = torch.randn(3, 4).to("tpu:2")
    path = tmp_path / "t.pt"
    torch.save({"x": x, "v": x[1:]}, path)
    loaded = torch.load(path)
    assert loaded["x"].device == torch.device("tpu", 2)
    assert torch.equal(loaded["x"].cpu(), x.cpu())
    on_cpu = torch.load(path, map_location="cpu")
    assert on_cpu["x"].device.type == "cpu" and torch.equal(on_cpu["x"], x.cpu())
    on_tpu1 = torch.load(path, map_location="tpu:1")
    assert on_tpu1["x"].device == torch.device("tpu", 1)


@pytest.mark.devices(8)
def test_printing_shows_values_and_device():
    text = repr(torch.tensor([1.5, 2.5]).to("tpu:3"))
    assert "1.5000" in text and "device='tpu:3'" in text


def test_rng_is_reproducible_and_state_round_trips():
    torch.tpu.manual_seed(123)
    a = torch.randn(5, device="tpu").cpu()
    state = torch.tpu.get_rng_state()
    b = torch.randn(5, device="tpu").cpu()
    torch.tpu.manual_seed(123)
    assert torch.equal(torch.randn(5, device="tpu").cpu(), a)
    torch.tpu.set_rng_state(state)
    assert torch.equal(torch.randn(5, device="tpu").cpu(), b)
    assert not torch.equal(a, b)


@pytest.mark.devices(8)
def test_memory_stats_track_allocations():
    torch.tpu.reset_peak_memory_stats(4)
    before = torch.tpu.memory_allocated(4)
    x = torch.empty(1024, 1024, device="tpu:4")
    assert torch.tpu.memory_allocated(4) >= before + 4 * 1024 * 1024
    assert torch.tpu.max_memory_allocated(4) >= before + 4 * 1024 * 1024
    del x


@pytest.mark.devices(8)
def test_device_module_api():
    torch.tpu.set_device(2)
    try:
        assert torch.tpu.current_device() == 2
        assert torch.empty(1, device="tpu").device.index == 2
    finally:
        torch.tpu.set_device(0)
    assert torch.tpu.get_device_name(0)
    torch.tpu.synchronize()
    stream = torch.tpu.current_stream()
    event = stream.record_event()
    event.synchronize()
    with torch.tpu.stream(torch.tpu.Stream()):
        pass


# `.to` and `copy_` copy the host memory before the transfer; `module.to` transfers from the
# weights' own memory and waits at its end. An in-place write right after must reach no copy,
# small or large (16 MB: a transfer still reading it would see the write).
@pytest.mark.parametrize("rows", [4, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("how", ["to", "copy_", "module.to"])
def test_host_to_device_copy_does_not_alias_host_memory(rows, dtype, how):
    expected = torch.arange(rows * 4).reshape(rows, 4).to(dtype)
    host = expected.clone()
    if how == "to":
        device_tensor = host.to("tpu")
    elif how == "copy_":
        device_tensor = torch.empty(rows, 4, dtype=dtype, device="tpu").copy_(host)
    else:
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(host, requires_grad=dtype.is_floating_point)
        device_tensor = module.to("tpu").weight
    host.add_(100)
    assert torch.equal(device_tensor.cpu(), expected)


@pytest.mark.parametrize("source,target", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.int64), (torch.int64, torch.float32),
    (torch.float64, torch.float32), (torch.bool, torch.float32), (torch.float32, torch.bool),
    (torch.int32, torch.int8), (torch.float32, torch.float16)])
def test_host_to_device_copy_with_a_dtype_casts_as_torch_does(source, target):
    host = (torch.randn(5, 6, generator=torch.Generator().manual_seed(0)) * 200).to(source)
    expected = host.to(target)
    moved = host.to("tpu", target)
    assert moved.dtype == target and torch.equal(moved.cpu(), expected)
    into_view = torch.zeros(6, 5, dtype=target, device="tpu").t()
    into_view.copy_(host)
    assert torch.equal(into_view.cpu(), expected)


# An operator with a CPU kernel only: no lowering and no decomposition exist for it, whatever
# the op table grows to cover.
_test_library = torch.library.Library("tpu_train_test", "DEF")
_test_library.define("cpu_only_square(Tensor x) -> Tensor")
_test_library.impl("cpu_only_square", lambda x: x * x, "CPU")
cpu_only_square = torch.ops.tpu_train_test.cpu_only_square.default


def test_op_error_inside_backward_raises_instead_of_aborting():
    class NeedsUnsupportedOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return cpu_only_square(grad)

    x = torch.ones(3, device="tpu", requires_grad=True)
    with pytest.raises(NotImplementedError, match="cpu_only_square.*tpu"):
        NeedsUnsupportedOp.apply(x).sum().backward()


def test_error_in_a_backward_op_without_meta_kernel_raises_instead_of_aborting():
    # multi_margin_loss_backward has no meta kernel, and autograd calls it from a C++ node:
    # the error is reported once backward ends (a stand-in result comes from the CPU kernel).
    from tpu_train.ops import registry

    op = torch.ops.aten.multi_margin_loss_backward.default
    lowering = registry.get_lowering(op).fn

    def refuse(*args, **kwargs):
        raise NotImplementedError("multi_margin_loss_backward refused by this test")

    registry.lowers(op, override=True)(refuse)
    try:
        x = torch.randn(3, 5).to("tpu").requires_grad_()
        loss = torch.nn.functional.multi_margin_loss(x, torch.tensor([1, 0, 4]).to("tpu"))
        with pytest.raises(NotImplementedError, match="refused by this test"):
            loss.backward()
    finally:
        registry.lowers(op, override=True)(lowering)


def test_unsupported_op_names_the_op_and_the_device():
    x = torch.ones(2, 3, device="tpu")
    with pytest.raises(NotImplementedError,
                       match=r"tpu_train_test\.cpu_only_square.*not implemented for the tpu device"):
        cpu_only_square(x)


def test_cpu_fallback_runs_the_op_with_one_warning(monkeypatch):
    monkeypatch.setenv("TPU_TRAIN_CPU_FALLBACK", "1")
    x = torch.randn(2, 3)
    with pytest.warns(UserWarning, match="cpu_only_square.*CPU"):
        got = cpu_only_square(x.to("tpu"))
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), x * x)


@pytest.mark.devices(8)
def test_storage_resize_keeps_memory_accounting():
    x = torch.ones(256, 256, device="tpu:6")
    before = torch.tpu.memory_allocated(6)
    x._storage.resize(0)
    assert torch.tpu.memory_allocated(6) == before - 256 * 256 * 4
    x._storage.resize(256 * 256)
    assert torch.tpu.memory_allocated(6) == before
    del x
    assert torch.tpu.memory_allocated(6) == before - 256 * 256 * 4


def test_tolist_and_numpy_convert_like_cuda_tensors():
    base = torch.arange(12, dtype=torch.float32).view(3, 4)
    on_device = base.to(tpu_train.device(0))
    # a non-contiguous view, an integer tensor and a 0-d tensor convert through host memory
    assert on_device.t().tolist() == base.t().tolist()
    assert on_device.long().tolist() == base.long().tolist()
    assert on_device[1, 2].tolist() == 6.0
    with pytest.raises(TypeError, match=r"can't convert tpu:0 device type tensor to numpy"):
        on_device.numpy()
    assert (on_device.numpy(force=True) == base.numpy()).all()


def test_lazy_conjugate_and_negative_views_give_torch_values():
    # torch.fft.ifft of a real tensor is conj(fft) / n through the lazy conj view: its flag
    # would be lost on a wrapper subclass, giving the unconjugated spectrum.
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch.fft.ifft(x.to("tpu")).cpu(), torch.fft.ifft(x))
    z = torch.complex(x, x.flip(0))
    on_device = z.to("tpu")
    torch.testing.assert_close(on_device.conj().cpu(), z.conj().resolve_conj())
    torch.testing.assert_close((on_device.conj() * 2).cpu(), z.conj() * 2)
    torch.testing.assert_close(torch._neg_view(on_device).cpu(), -z)
    # Autograd through conj (mH): gradients equal CPU's.
    a = z[:, :4].clone().requires_grad_()
    b = a.detach().to("tpu").requires_grad_()
    (a @ a.mH).abs().sum().backward()
    (b @ b.mH).abs().sum().backward()
    torch.testing.assert_close(b.grad.cpu(), a.grad)


def test_resize_as_follows_resize():
    x = torch.arange(12.0).to("tpu")
    x.resize_as_(torch.empty(2, 3, device="tpu"))
    assert x.shape == (2, 3) and x.stride() == (3, 1)
    torch.testing.assert_close(x.cpu(), torch.arange(6.0).view(2, 3))
    x.resize_as_(torch.empty(3, 4))  # back within the storage it was created with
    torch.testing.assert_close(x.cpu(), torch.arange(12.0).view(3, 4))


def test_view_as_real_and_complex_are_copies_with_torch_values():
    # Meta's Llama RoPE: complex rotation through view_as_complex / view_as_real.
    generator = torch.Generator().manual_seed(0)
    xq = torch.randn(2, 5, 4, 8, generator=generator)
    freqs = torch.polar(torch.ones(5, 1, 4), torch.randn(5, 1, 4, generator=generator))

    def rope(x, f):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * f).flatten(3)

    torch.testing.assert_close(rope(xq.to("tpu"), freqs.to("tpu")).cpu(), rope(xq, freqs))
    # Complex autograd formulas read view_as_real: the FFT's gradient equals CPU's.
    a = xq[0, 0].clone().requires_grad_()
    b = a.detach().to("tpu").requires_grad_()
    torch.fft.fft(a).abs().sum().backward()
    torch.fft.fft(b).abs().sum().backward()
    torch.testing.assert_close(b.grad.cpu(), a.grad)


def test_efficient_zero_tensor_is_zeros_on_the_device():
    # What autograd creates for gradients known to be zero (sgn's at a complex 0, ...).
    zeros = torch.ops.aten._efficientzerotensor([2, 3], dtype=torch.float32, device="tpu")
    assert zeros.device.type == "tpu" and zeros.shape == (2, 3)
    assert torch.equal(zeros.cpu(), torch.zeros(2, 3))
    x = torch.tensor([0j, 1 + 1j]).to("tpu").requires_grad_()
    torch.sgn(x).abs().sum().backward()
    want = torch.tensor([0j, 1 + 1j], requires_grad=True)
    torch.sgn(want).abs().sum().backward()
    torch.testing.assert_close(x.grad.cpu(), want.grad)


def test_empty_is_filled_when_first_read_and_a_whole_copy_never_fills_it(monkeypatch):
    """``torch.empty``'s storage gets its buffer (zeros, deterministic) when first read; a
    tensor that is overwritten whole first, as ``.to("tpu")`` and ``module.to("tpu")``
    overwrite the ``empty`` they make, is never filled: no fill program, no fill recorded in a
    region, no zeros copied from the host. Its bytes count as allocated from the start."""
    from tpu_train.device import factories, storage

    before = torch.tpu.memory_allocated(0)
    unread = torch.empty(64, 64, device="tpu")
    assert torch.tpu.memory_allocated(0) >= before + 64 * 64 * 4

    def no_fill(*args):
        raise AssertionError("a fill was made")

    for module in (storage, factories):  # where a fill of an empty would be made
        monkeypatch.setattr(module, "allocate", no_fill)
    host = torch.randn(3, 5)
    moved = host.to("tpu")
    layer = torch.nn.Linear(5, 2)
    placed = copy.deepcopy(layer).to("tpu")
    assert torch.equal(moved.cpu(), host)
    assert torch.equal(placed.weight.cpu(), layer.weight) and torch.equal(placed.bias.cpu(), layer.bias)
    with pytest.raises(AssertionError, match="a fill was made"):
        unread.cpu()  # the first read makes it
    monkeypatch.undo()
    assert torch.equal(unread.cpu(), torch.zeros(64, 64))
    with tpu_train.eager_mode("fused"):  # made inside a recorded region, where it is read
        grown = torch.empty(4, dtype=torch.int32, device="tpu")
        grown += 3
    assert torch.equal(grown.cpu(), torch.full((4,), 3, dtype=torch.int32))
