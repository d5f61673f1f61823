"""Mesh degrees: inference of -1, validation errors, model divisibility, device order."""

import types

import jax
import numpy as np
import pytest

from tpu_train.models import LLAMA, get_config
from tpu_train.parallel.mesh import (AXES, MeshError, MeshShape, build_mesh,
                                     check_divisibility, device_grid, mesh_from_config,
                                     resolve_mesh_shape)
from tpu_train.trainer.config import ParallelConfig


@pytest.mark.parametrize("degrees, expected", [
    ((-1, 1, 1), (8, 1, 1, 1, 1)),
    ((1, -1, 1), (1, 8, 1, 1, 1)),
    ((1, -1, 2), (1, 4, 1, 1, 2)),
    ((2, 2, -1), (2, 2, 1, 1, 2)),
    ((2, 2, 2), (2, 2, 1, 1, 2)),
])
def test_resolve_infers_the_missing_degree(degrees, expected):
    # sizes in AXES order: (data, fsdp, expert, context, tensor)
    assert resolve_mesh_shape(8, *degrees).sizes == expected


def test_expert_axis_splits_the_batch_and_checks_the_experts():
    from tpu_train.models import MIXTRAL
    from tpu_train.parallel.mesh import check_divisibility

    experts = MIXTRAL.split_sizes(MIXTRAL.config("mixtral_tiny"))
    shape = resolve_mesh_shape(8, data=-1, fsdp=1, tensor=1, expert=4)
    assert shape.sizes == (2, 1, 4, 1, 1) and shape.batch_shards == 8
    check_divisibility(experts, shape)  # 8 experts over 4
    with pytest.raises(MeshError, match="parallel.expert=16 must divide the model's n_experts=8"):
        check_divisibility(experts, resolve_mesh_shape(16, data=1, expert=16))
    with pytest.raises(MeshError, match="has no experts"):
        check_divisibility(LLAMA.split_sizes(get_config("debug_tiny")), shape)


@pytest.mark.parametrize("degrees, message", [
    ((2, 2, 1), "= 4, but there are 8 devices"),
    ((-1, -1, 1), "at most one of parallel.data/fsdp/expert/tensor may be -1"),
    ((-1, 3, 1), "cannot infer parallel.data"),
    ((0, 8, 1), "parallel.data must be a positive int or -1"),
    ((1, 8, 1.5), "parallel.tensor must be an int"),
    ((1, True, 8), "parallel.fsdp must be an int"),
])
def test_resolve_rejects_bad_degrees(degrees, message):
    with pytest.raises(MeshError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_mesh_shape(8, *degrees)


def test_multi_slice_puts_slices_on_data_by_default():
    shape = resolve_mesh_shape(512, data=2, fsdp=-1, tensor=4, num_slices=2)
    assert shape == MeshShape(2, 64, 4, dcn_data=2, dcn_fsdp=1)
    assert shape.ici == (1, 64, 1, 1, 4) and shape.dcn == (2, 1, 1, 1, 1)
    with pytest.raises(MeshError, match="not a multiple of its 2 cross-slice"):
        resolve_mesh_shape(512, data=1, fsdp=-1, tensor=4, num_slices=2)
    with pytest.raises(MeshError, match="must equal the number of slices"):
        resolve_mesh_shape(512, data=2, fsdp=-1, tensor=4, num_slices=2, dcn_data=2,
                           dcn_fsdp=2)


def test_model_divisibility_names_the_offending_dimension():
    # 32 heads, 8 kv heads, ffn 14336, dim 4096
    sizes = LLAMA.split_sizes(get_config("llama3_1_8b"))
    check_divisibility(sizes, MeshShape(1, 64, 8))
    with pytest.raises(MeshError, match=r"does not divide n_kv_heads=8"):
        check_divisibility(sizes, MeshShape(1, 4, 16))
    with pytest.raises(MeshError, match=r"tensor=3 .* n_heads=32, n_kv_heads=8"):
        check_divisibility(sizes, MeshShape(1, 1, 3))
    with pytest.raises(MeshError, match=r"fsdp=3 must divide the model width dim=4096"):
        check_divisibility(sizes, MeshShape(1, 3, 1))


@pytest.mark.devices(8)
def test_build_mesh_on_eight_virtual_devices():
    assert len(jax.devices()) == 8, "tests/conftest.py should give 8 virtual CPU devices"
    mesh = build_mesh(data=2, fsdp=-1, tensor=2)
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    with pytest.raises(MeshError, match="tensor=8 .* n_kv_heads=2"):
        build_mesh(1, 1, 8, split_sizes=LLAMA.split_sizes(get_config("debug_tiny")))


@pytest.mark.devices(8)
def test_mesh_from_config_accepts_the_schema_and_mappings():
    mesh = mesh_from_config(ParallelConfig())  # data=-1, fsdp=1, tensor=1
    assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    mesh = mesh_from_config({"data": 1, "fsdp": 4, "tensor": -1})
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}


def _fake_tpu_devices(slices, per_slice):
    return [types.SimpleNamespace(id=s * per_slice + i, slice_index=s, platform="tpu",
                                  device_kind="fake", process_index=s)
            for s in range(slices) for i in range(per_slice)]


def test_hybrid_grid_keeps_each_slice_contiguous_on_the_dcn_axis():
    # JAX's hybrid helper lays out per-slice (ICI) meshes; a fake device kind with no
    # physical coordinates is arranged in order inside each slice.
    devices = [types.SimpleNamespace(**{**vars(d), "platform": "cpu"})
               for d in _fake_tpu_devices(2, 4)]
    shape = resolve_mesh_shape(8, data=2, fsdp=4, tensor=1, num_slices=2)
    grid = device_grid(shape, devices)
    assert grid.shape == (2, 4, 1, 1, 1)
    slices = np.vectorize(lambda d: d.slice_index)(grid)
    assert (slices[0] == 0).all() and (slices[1] == 1).all()
    with pytest.raises(MeshError, match="spans 2 slices over DCN but the devices belong to 1"):
        device_grid(shape, _fake_tpu_devices(1, 8))


@pytest.mark.devices(8)
def test_context_axis_splits_the_devices_with_the_others():
    shape = resolve_mesh_shape(8, data=1, fsdp=-1, tensor=2, context=2)
    assert shape.sizes == (1, 2, 1, 2, 2) and shape.batch_shards == 2
    mesh = build_mesh(1, 2, 1, context=4)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "expert": 1, "context": 4, "tensor": 1}
    assert dict(mesh_from_config({"fsdp": -1, "context": 2, "data": 1}).shape)["fsdp"] == 4
    with pytest.raises(MeshError, match=r"tensor \* context = 1 \* 2 \* 1 \* 2 = 4, but"):
        resolve_mesh_shape(8, 1, 2, 1, context=2)
    with pytest.raises(MeshError, match="parallel.context must be a positive int"):
        resolve_mesh_shape(8, -1, 1, 1, context=-1)


@pytest.mark.devices(8)
def test_expert_and_context_axes_hold_together():
    shape = resolve_mesh_shape(8, data=-1, fsdp=1, tensor=1, expert=2, context=2)
    assert shape.sizes == (2, 1, 2, 2, 1) and shape.batch_shards == 4
    mesh = mesh_from_config({"data": 1, "fsdp": 1, "expert": 2, "context": 4})
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "expert": 2, "context": 4, "tensor": 1}
    with pytest.raises(MeshError, match=r"fsdp \* expert \* tensor \* context = "
                                        r"1 \* 2 \* 2 \* 1 \* 2 = 8, but there are 16"):
        resolve_mesh_shape(16, 1, 2, 1, expert=2, context=2)
