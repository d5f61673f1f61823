"""``tpu_train.compile.targets`` and ``lower_train_step(..., target=...)``: compiling the step
with XLA's TPU compiler for chips that are not attached. The compiling tests need libtpu
(``pip install tpu_train[tpu]``; CI installs it) and use a tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tpu_train.compile import lower_train_step
from tpu_train.compile import targets
from tpu_train.compile.targets import TargetError, resolve_target
from tpu_train.models import Llama, LlamaConfig
from tests.markers import needs_libtpu

TINY = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                   ffn_hidden_dim=128, max_seq_len=32)


def _meta_step(batch: int = 4):
    with torch.device("meta"):
        model = Llama(TINY)
        data = {"tokens": torch.empty(batch, 32, dtype=torch.int64),
                "labels": torch.empty(batch, 32, dtype=torch.int64)}
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), data


def _loss(model, batch):
    return F.cross_entropy(model(batch["tokens"]).float().flatten(0, 1), batch["labels"].flatten())


@pytest.mark.parametrize("name,message", [
    ("v9", "unknown TPU generation in target 'v9'"),
    ("", "is empty"),
    ("v5e:2x", "bad topology in TPU target 'v5e:2x'"),
    ("v5e:2x2x1", "a v5e topology has 2 non-zero dimensions"),
    ("v5p:0x2x2", "a v5p topology has 3 non-zero dimensions"),
])
def test_bad_names_are_one_line_errors(name, message):
    with pytest.raises(TargetError, match=message) as error:
        resolve_target(name)
    assert "\n" not in str(error.value)


def test_without_libtpu_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setattr(targets, "libtpu_available", lambda: False)
    with pytest.raises(TargetError, match=r"'v5e:2x2' needs XLA's TPU compiler: "
                                          r"pip install tpu_train\[tpu\]"):
        resolve_target("v5e:2x2")


@needs_libtpu
@pytest.mark.parametrize("name,canonical,chips,kind", [
    ("v5e", "v5e:1x1", 1, "TPU v5 lite"),
    ("V5litepod:2x2", "v5e:2x2", 4, "TPU v5 lite"),
    ("v5p:2x2x1", "v5p:2x2x1", 4, "TPU v5"),
    ("v6e:2x4", "v6e:2x4", 8, "TPU v6 lite"),
])
def test_named_topologies_give_compile_only_devices(name, canonical, chips, kind):
    target = resolve_target(name)
    assert (target.name, target.num_chips, target.device_kind) == (canonical, chips, kind)
    assert len(target.devices) == chips
    mesh = target.mesh((chips,), ("data",))
    assert mesh.devices.shape == (chips,)


@needs_libtpu
def test_several_slices_give_each_device_its_slice():
    two = resolve_target("v5e:2x2", num_slices=2)
    assert (two.name, two.num_slices, two.num_chips, len(two.devices)) == ("v5e:2x2", 2, 8, 8)
    assert sorted(d.slice_index for d in two.devices) == [0] * 4 + [1] * 4
    with pytest.raises(TargetError, match="num_slices must be a positive int, got 0"):
        resolve_target("v5e:2x2", num_slices=0)


@needs_libtpu
def test_a_topology_libtpu_rejects_is_one_line():
    with pytest.raises(TargetError, match=r"TPU target 'v5e:3x3': libtpu cannot build it \("):
        resolve_target("v5e:3x3")
    with pytest.raises(TargetError, match="hold 2 devices, target v5e:2x2 has 4"):
        resolve_target("v5e:2x2").mesh((2,), ("data",))


@needs_libtpu
def test_step_compiles_for_one_v5e_chip():
    model, optimizer, batch = _meta_step()
    program = lower_train_step(model, optimizer, _loss, batch, target="v5e",
                               autocast_dtype=torch.bfloat16, max_grad_norm=1.0,
                               skip_non_finite=True)
    analysis = program.analysis()
    assert analysis["flops_per_device"] > 0 and analysis["bytes_accessed_per_device"] > 0
    assert analysis["temp_size_in_bytes"] > 0
    # XLA's TPU compiler wrote the program: TPU layouts carry tiling, e.g. "{1,0:T(8,128)}".
    text = program.executable.as_text()
    assert ":T(" in text
    # Skipping a non-finite update is a select fused into the update, not a conditional
    # (tpu_train.compile.program.skips_by_select).
    assert " conditional(" not in text


@needs_libtpu
# The mesh is made of 4 of this process's devices, then laid over the target's chips: a host
# with one chip cannot make it.
@pytest.mark.devices(4)
def test_a_mesh_is_laid_over_the_target_chips():
    import jax
    from jax.sharding import Mesh

    from tpu_train.models import LLAMA
    from tpu_train.parallel import sharding_plan

    model, optimizer, batch = _meta_step(batch=4)
    # Any 4 devices: only the mesh's axes count, laid over the target's chips.
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(4, 1, 1), ("data", "fsdp", "tensor"))
    program = lower_train_step(model, optimizer, _loss, batch, mesh=mesh, plan=sharding_plan(LLAMA),
                               target="v5e:2x2")
    shardings = program.lowered.compile().input_shardings[0]
    devices = {d for s in jax.tree.leaves(shardings) for d in s.device_set}
    assert {d.device_kind for d in devices} == {"TPU v5 lite"} and len(devices) == 4
    with pytest.raises(TargetError, match="has 4 chips but the step has no mesh and plan"):
        lower_train_step(model, optimizer, _loss, batch, target="v5e:2x2", compile=False)
