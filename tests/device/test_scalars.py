"""Python numbers passed to executables as device arrays kept once per value (device/scalars.py).

Oracle: the same ops in PyTorch on CPU; the values kept apart are told apart by their bits.
"""

import math

import pytest

import torch

import tpu_train
from tpu_train.device import scalars

TPU = torch.device("tpu", 0)


def test_values_that_compare_equal_are_kept_apart():
    values = [0.0, -0.0, math.nan, 1.0, 1, True, 2.5]
    arrays = [scalars.on_device(v, 0) for v in values]
    assert math.copysign(1.0, float(arrays[0])) == 1.0
    assert math.copysign(1.0, float(arrays[1])) == -1.0
    assert math.isnan(float(arrays[2]))
    assert [str(a.dtype) for a in arrays[3:6]] == ["float32", "int32", "bool"]
    assert arrays[3].weak_type and arrays[4].weak_type  # as JAX types a Python number
    assert scalars.on_device(2.5, 0) is arrays[6]  # one transfer per value
    assert scalars.on_device(math.nan, 0) is not None


def test_a_float_keeps_the_weak_type_of_a_python_number():
    """bf16 * 0.375 stays bf16 (torch's and JAX's rule for a Python number), through the lowered
    path, the in-place path and fused mode."""
    x = torch.linspace(-2, 2, 24).reshape(4, 6).to(torch.bfloat16)
    expected = [x * 0.375, x + 0.75, x.clone().mul_(-0.0)]
    for mode in ("strict", "fused"):
        with tpu_train.eager_mode(mode):
            t = x.to(TPU)
            got = [t * 0.375, t + 0.75, t.clone().mul_(-0.0)]
            for a, b in zip(got, expected):
                assert a.dtype == torch.bfloat16
                assert torch.equal(a.cpu().view(torch.int16), b.view(torch.int16))  # -0.0 too


def test_foreach_scalar_lists_and_changing_values_match_cpu():
    def run(device):
        params = [torch.linspace(0, 1, n, device=device) for n in (3, 5, 7)]
        others = [p * 2 + 1 for p in params]
        for step in range(1, 4):
            torch._foreach_addcdiv_(params, others, others, [0.1 * step, -0.2 / step, 0.0])
            torch._foreach_mul_(params, 1.0 - 0.01 * step)
        return params

    for a, b in zip(run(TPU), run(torch.device("cpu"))):
        torch.testing.assert_close(a.cpu(), b)


def test_factories_fill_with_the_exact_value():
    assert torch.equal(torch.full((3,), -0.0, device=TPU).cpu().view(torch.int32),
                       torch.full((3,), -0.0).view(torch.int32))
    assert torch.full((2,), 7, device=TPU).cpu().tolist() == [7, 7]
    assert torch.full((2,), True, device=TPU).cpu().tolist() == [True, True]


@pytest.mark.devices(2)
def test_each_device_gets_its_own_copy():
    for mode in ("strict", "fused"):
        with tpu_train.eager_mode(mode):
            a = torch.ones(3, device="tpu:1") * 0.625
            b = torch.ones(3, device="tpu:0") * 0.625
            torch._foreach_mul_([a], 2.0)
            assert a.cpu().tolist() == [1.25] * 3 and b.cpu().tolist() == [0.625] * 3
    assert {d.id for d in scalars.on_device(0.625, 1).devices()} != \
        {d.id for d in scalars.on_device(0.625, 0).devices()}


@pytest.mark.devices(2)
def test_a_tensor_sharded_over_devices_takes_python_numbers():
    """A parameter sharded over a mesh (what data parallelism in one process makes of it) runs
    its eager ops on every device of the mesh: its numbers stay Python numbers there, for JAX
    to place, rather than arrays kept on one device."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tpu_train.device import runtime, storage_of

    devices = np.array([runtime.jax_device(i) for i in range(2)])
    sharding = NamedSharding(Mesh(devices, ("x",)), PartitionSpec("x"))
    x = torch.linspace(-2, 2, 8)
    expected = [x * 0.7, x + 0.25, x.clone().mul_(0.7)]
    t = x.to(TPU)
    storage = storage_of(t)
    storage.buffer = jax.device_put(storage.buffer, sharding)
    got = [t * 0.7, t + 0.25, t.clone().mul_(0.7)]
    for a, b in zip(got, expected):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool, torch.bfloat16])
def test_item_of_an_element_of_a_small_storage_matches_cpu(dtype):
    """``.item()`` reads the elements of a small storage (a compiled step's metrics vector) from
    the buffer's host copy: each view's own element, in the view's dtype, as on CPU."""
    cpu = torch.tensor([1.5, -2.25, 0.0, 7.0, 3.0]).to(dtype)
    tpu = cpu.to(TPU)
    for i in range(cpu.numel()):
        value = tpu[i].item()
        assert type(value) is type(cpu[i].item()) and value == cpu[i].item(), i
    assert tpu[1:4][2].item() == cpu[3].item()  # a view of a view: the offset is the storage's
