"""The CPU client's gloo all-reduce, in one process: the transport setting, which tensors it
takes, and the in-place reduction's ownership rule (the 2- and 4-process results against
gloo are in test_collectives.py)."""

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

import tpu_train  # noqa: F401
from tpu_train.device import runtime, storage_of
from tpu_train.distributed import host_transport

# gloo's transport listens on a loopback socket even for one rank.
pytestmark = pytest.mark.multiprocess


@pytest.fixture
def single():
    """A one-rank GlooAllReduce over an in-memory store."""
    return host_transport.GlooAllReduce(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30),
                                        "test", runtime.jax_device(0), 0)


def test_the_transport_setting_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(host_transport.TRANSPORT_ENV, "XLA")
    assert host_transport.transport() == "xla"
    monkeypatch.setenv(host_transport.TRANSPORT_ENV, "nccl")
    with pytest.raises(ValueError, match="TPU_TRAIN_CPU_ALLREDUCE='nccl'.*gloo, xla"):
        host_transport.transport()


def test_bool_tensors_and_unknown_ops_stay_with_xla(single):
    assert single.supports([torch.ones(3, device="tpu")], "sum")
    assert single.supports([torch.ones(3, dtype=torch.bfloat16), torch.ones(2)], "avg")
    assert not single.supports([torch.ones(3, dtype=torch.bool, device="tpu")], "max")
    assert not single.supports([torch.ones(3, dtype=torch.bool)], "max")
    assert not single.supports([torch.ones(3, device="tpu")], "premul_sum")


def test_an_array_computed_by_xla_is_reduced_in_its_own_memory(single):
    tensor = torch.arange(6.0, device="tpu").reshape(2, 3) * 2
    address = storage_of(tensor).buffer.unsafe_buffer_pointer()
    single.launch([tensor], "sum")()
    assert single.in_place == 1
    assert storage_of(tensor).buffer.unsafe_buffer_pointer() == address
    torch.testing.assert_close(tensor.cpu(), torch.arange(6.0).reshape(2, 3) * 2)


def test_views_and_shared_arrays_are_copied_not_donated(single):
    base = torch.arange(12.0, device="tpu") * 1
    single.launch([base[2:8]], "avg")()  # a view: its storage is larger
    # An array held beyond its storage (here by the test) is never reduced in its memory.
    held = storage_of(base).buffer
    single.launch([base], "max")()
    assert single.in_place == 0
    assert not held.is_deleted()
    torch.testing.assert_close(torch.from_numpy(np.asarray(held).copy()), torch.arange(12.0))
    torch.testing.assert_close(base.cpu(), torch.arange(12.0))


def test_average_needs_floating_point(single):
    with pytest.raises(TypeError, match="AVG needs floating-point"):
        single.launch([torch.ones(3, dtype=torch.int32, device="tpu")], "avg")


def test_empty_scalar_and_bf16_tensors(single):
    empty = torch.ones(0, 3, device="tpu") * 1
    scalar = torch.tensor(2.5, device="tpu") * 1
    half = torch.arange(5.0, device="tpu").to(torch.bfloat16) * 1
    single.launch([empty, scalar, half], "sum")()
    assert empty.shape == (0, 3)
    assert scalar.item() == 2.5
    torch.testing.assert_close(half.cpu(), torch.arange(5.0).to(torch.bfloat16))
