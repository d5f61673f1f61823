"""The FSDP2 storage adaptation in one process: free/alloc keep views valid, other tensors go
to torch's helpers, the fsdp ops match their CPU kernels, and changed helpers fail loudly."""

import types

import pytest
import torch

import tpu_train  # noqa: F401
import tpu_train.distributed  # noqa: F401
from tpu_train.device import storage_of
from tpu_train.distributed import fsdp_compat
from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group


def test_installed_in_every_module_that_imported_the_helpers():
    assert fsdp_compat.installed()
    assert _fsdp_param.alloc_storage is fsdp_compat.alloc_storage
    assert _fsdp_param.free_storage is fsdp_compat.free_storage
    assert _fsdp_param_group.alloc_storage is fsdp_compat.alloc_storage


def test_free_then_alloc_keeps_views_and_geometry():
    base = torch.arange(12.0).to("tpu")
    view = base[4:].view(2, 4)  # what FSDP's unsharded parameter is to its all-gather output
    fsdp_compat.free_storage(base)
    assert storage_of(base).numel == 0 and storage_of(view) is storage_of(base)
    assert base.shape == (12,) and view.shape == (2, 4) and view.storage_offset() == 4
    fsdp_compat.alloc_storage(base)
    assert storage_of(base).numel == 12
    base.copy_(torch.arange(12.0, 24.0))  # as the all-gather writes it
    assert torch.equal(view.cpu(), torch.arange(16.0, 24.0).view(2, 4))
    fsdp_compat.alloc_storage(base)  # already allocated: contents stay
    assert torch.equal(base.cpu(), torch.arange(12.0, 24.0))


def test_cpu_tensors_use_torchs_helpers():
    t = torch.ones(6)
    fsdp_compat.free_storage(t)
    assert t.untyped_storage().size() == 0
    fsdp_compat.alloc_storage(t)
    assert t.untyped_storage().size() == 6 * 4


def _data(shape, salt):
    return torch.randn(shape, generator=torch.Generator().manual_seed(salt))


def test_fsdp_ops_match_cpu():
    # all_gather_copy_in: this rank's inputs land in its slot of the output
    inputs = [_data((6,), 1), _data((4,), 2)]  # FSDP passes flat inputs
    out_cpu, out_tpu = torch.zeros(20), torch.zeros(20).to("tpu")
    want = torch.ops.fsdp.all_gather_copy_in(inputs, out_cpu, [6, 4], 10, 1)
    got = torch.ops.fsdp.all_gather_copy_in([t.to("tpu") for t in inputs], out_tpu, [6, 4], 10, 1)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(out_tpu.cpu(), out_cpu)
    # split_with_sizes_copy into strided destinations
    source = _data((2, 7), 3)
    outs_cpu = [torch.zeros(2, 3), torch.zeros(4, 2).t()]
    outs_tpu = [torch.zeros(2, 3).to("tpu"), torch.zeros(4, 2).to("tpu").t()]
    torch.ops.fsdp.split_with_sizes_copy(source, [3, 4], dim=1, out=outs_cpu)
    torch.ops.fsdp.split_with_sizes_copy(source.to("tpu"), [3, 4], dim=1, out=outs_tpu)
    for g, w in zip(outs_tpu, outs_cpu):
        assert torch.equal(g.cpu(), w)
    # chunk_cat with uneven (padded) first dims and a non-contiguous input
    grads = [_data((5, 2), 4), _data((3, 4), 5).t(), _data((1,), 6)]
    want = torch.zeros(2, 13)
    torch.ops.fsdp.chunk_cat(grads, 0, 2, out=want)
    got = torch.zeros(2, 13).to("tpu")
    torch.ops.fsdp.chunk_cat([g.to("tpu") for g in grads], 0, 2, out=got)
    assert torch.equal(got.cpu(), want)


def test_changed_helpers_fail_loudly():
    def alloc_storage(tensor, size):  # a new signature
        tensor.untyped_storage().resize_(size)

    def free_storage(tensor):  # a different mechanism
        tensor.untyped_storage().fill_(0)

    module = types.SimpleNamespace(__name__="fake", alloc_storage=alloc_storage,
                                   free_storage=free_storage)
    with pytest.raises(fsdp_compat.FsdpCompatError, match="alloc_storage changed"):
        fsdp_compat._check_helper(module, "alloc_storage")
    with pytest.raises(fsdp_compat.FsdpCompatError, match="free_storage changed"):
        fsdp_compat._check_helper(module, "free_storage")
    with pytest.raises(fsdp_compat.FsdpCompatError, match="no longer exists"):
        fsdp_compat._check_helper(types.SimpleNamespace(__name__="fake"), "free_storage")
    # and torch's real ones pass the same check
    for name in ("alloc_storage", "free_storage"):
        fsdp_compat._check_helper(types.SimpleNamespace(
            __name__="torch", **{name: fsdp_compat._state["original"][name]}), name)
