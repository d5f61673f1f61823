"""The compiled PyTorch step under SPMD equals the single-device step; FSDP divides memory.

``compile_train_step(model, AdamW, loss, mesh=..., plan=sharding_plan(LLAMA))`` on a tiny Llama,
on the
8 virtual CPU devices of the test session, against the same step compiled for one device.
"""

import copy
import dataclasses
import functools
import re

import jax
import pytest
import torch

import tpu_train
from tpu_train.compile import compile_train_step
from tpu_train.device import storage_of
from tpu_train.models import LLAMA
from tpu_train.parallel import (build_mesh, flat_storage_sharding, place_for_step, sharding_plan,
                                storage_bytes_per_device)

from tests.compile.helpers import assert_params_within, param_bound
from tests.parallel.spmd_model import CFG, batches, init_model, loss_fn
from tests.tolerances import loss_rtol

# Meshes over the session's 8 virtual devices.
pytestmark = pytest.mark.devices(8)

DEVICE = tpu_train.device(0)
STEPS = 10
# Float32 tolerances (tests/tolerances.py). Longest reduction in a step of the SPMD Llama:
# 128 (vocab 128, SwiGLU hidden 128, and the weight gradients' and the mean loss's sums over
# 8 x 16 tokens); a sharded sum only changes its order. Losses after n steps: loss_rtol(n).
SPMD_N = 128
F32 = torch.float32
MESHES = {"fsdp8": (1, 8, 1), "tp2_fsdp4": (1, 4, 2), "dp2_fsdp2_tp2": (2, 2, 2)}
_loss = loss_fn


def _batches():
    return batches(STEPS)


@functools.lru_cache(maxsize=None)
def _base():
    return init_model()


@functools.lru_cache(maxsize=None)
def _train(degrees):
    """(losses, model, optimizer, step) after STEPS steps; ``degrees=None``: one device."""
    model = copy.deepcopy(_base()).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    if degrees is None:
        step = compile_train_step(model, opt, _loss)
    else:
        mesh = build_mesh(*degrees, split_sizes=LLAMA.split_sizes(CFG))
        step = compile_train_step(model, opt, _loss, mesh=mesh, plan=sharding_plan(LLAMA))
        place_for_step(step)
    losses = []
    for batch in _batches():
        metrics = step({k: v.to(DEVICE) for k, v in batch.items()})
        losses.append(float(metrics["loss"]))
    return losses, model, opt, step


def _trained_tensors(model, opt):
    params = [p for p in model.parameters() if p.requires_grad]
    states = [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    return params + states


@pytest.mark.parametrize("layout", list(MESHES))
def test_losses_match_one_device(layout):
    reference, *_ = _train(None)
    losses, model, opt, step = _train(MESHES[layout])
    assert losses == pytest.approx(reference, rel=loss_rtol(F32, STEPS, SPMD_N))
    # Training moved: the comparison is not between ten copies of the initial loss.
    assert losses[-1] < losses[0]
    assert len(step.compilations) == 1  # placed up front: no recompile after the first step
    # Final parameters agree too. Sharded reductions sum in another order, and Adam divides
    # by sqrt(v), which magnifies that rounding for tiny gradients: an RMS bound per tensor
    # relative to the total update lr * STEPS (AdamW lr 3e-3, wd 0.1 = OPTIMIZERS["adamw"]).
    ref_model = _train(None)[1]
    assert_params_within(model, ref_model, param_bound("adamw", _base(), STEPS, SPMD_N))


STACK_CFG = dataclasses.replace(CFG, n_layers=3)
STACK_STEPS = 3
# The first layer's gradients pass through every layer's reductions, forward and back: six per
# layer (q/k/v, scores, values, output, the MLP's two), the head and the loss. The scanned and
# unrolled programs block their dots differently, so those chained roundings add up
# (tests/tolerances.py: depth).
STACK_DEPTH = 2 * (6 * STACK_CFG.n_layers + 2)


@functools.lru_cache(maxsize=None)
def _train_stack(degrees, scan_layers):
    """A 3-layer variant: (losses, model) after STACK_STEPS steps; ``degrees=None``: one
    device."""
    from tpu_train.models import Llama

    torch.manual_seed(0)
    model = Llama(STACK_CFG)
    model.init_weights(seed=0, device="cpu")
    model = model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    mesh = None if degrees is None else build_mesh(*degrees,
                                                   split_sizes=LLAMA.split_sizes(STACK_CFG))
    step = compile_train_step(model, opt, _loss, mesh=mesh,
                              plan=None if mesh is None else sharding_plan(LLAMA),
                              scan_layers=scan_layers)
    if mesh is not None:
        place_for_step(step)
    losses = [float(step({k: v.to(DEVICE) for k, v in b.items()})["loss"])
              for b in _batches()[:STACK_STEPS]]
    return losses, model, step


@pytest.mark.parametrize("layout", ["fsdp8", "tp2_fsdp4"])
def test_scanned_layers_match_the_unrolled_one_device_step(layout):
    # The decoder stack as one lax.scan over stacked, sharded weights (layer axis unsharded;
    # FSDP gathers one layer at a time inside the loop) against the unrolled program on one
    # device.
    from tpu_train.compile.layer_scan import LAYER_SCAN

    reference, ref_model, _ = _train_stack(None, False)
    losses, model, step = _train_stack(MESHES[layout], True)
    (program,) = step.cache.entries.values()
    assert sum(n.target is LAYER_SCAN for n in program.grad_graph.graph.nodes) == 1
    assert losses == pytest.approx(reference, rel=loss_rtol(F32, STACK_STEPS, SPMD_N))
    assert_params_within(model, ref_model, param_bound("adamw", ref_model, STACK_STEPS, SPMD_N,
                                                       depth=STACK_DEPTH))


def test_activation_checkpointing_under_fsdp_matches_one_device():
    # Checkpointed layers recompute from fenced inputs, and their weights are all-gathered
    # again where the recomputation reads them (program.py): same losses as one device.
    from tpu_train.parallel.activation_checkpointing import apply_activation_checkpointing

    steps = 3
    reference = _train(None)[0][:steps]
    model = copy.deepcopy(_base()).to(DEVICE)
    assert apply_activation_checkpointing(model) == CFG.n_layers
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    step = compile_train_step(model, opt, _loss,
                              mesh=build_mesh(1, 8, 1, split_sizes=LLAMA.split_sizes(CFG)),
                              plan=sharding_plan(LLAMA))
    place_for_step(step)
    losses = [float(step({k: v.to(DEVICE) for k, v in b.items()})["loss"])
              for b in _batches()[:steps]]
    assert losses == pytest.approx(reference, rel=loss_rtol(F32, steps, SPMD_N))


_GATHER_MEMORY_CHILD = '''
import json
from tpu_train.planning.analysis import compiled_step_analysis
print(json.dumps({f"{scan}/{layers}": compiled_step_analysis(
    "debug_tiny", data=1, fsdp=8, tensor=1, batch=8, seq_len=16, overrides={"n_layers": layers},
    activation_checkpointing=True, scan_layers=scan)["temp_size_in_bytes"]
    for scan in (False, True) for layers in (2, 6)}))
'''


def test_fsdp_gathers_under_checkpointing_do_not_pile_up():
    # With checkpointed layers weights are gathered where ops read them, a chunk of reads
    # (about a layer) at a time, each once the previous chunk has started; left free, XLA's
    # CPU scheduler issued every layer's forward all-gathers first, and four more layers
    # added four layers of gathered weights (+12.7 MB here). Measured in a child with the
    # plan command's analysis flags.
    import json
    import subprocess
    import sys

    from tpu_train.models import get_config
    from tpu_train.planning.analysis import virtual_devices_env

    env = virtual_devices_env(8)  # with the plan command's CPU analysis flags
    out = subprocess.run([sys.executable, "-c", _GATHER_MEMORY_CHILD], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    temp = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = get_config("debug_tiny")
    d, f, kv = cfg.dim, cfg.ffn_hidden_dim, cfg.n_kv_heads * cfg.head_dim
    one_layer_gathered = 4 * (2 * d * d + 2 * d * kv + 3 * d * f)  # fp32, 3.1 MB
    assert temp["False/6"] - temp["False/2"] < one_layer_gathered / 2, temp
    # Scanned, each layer's weights are gathered inside the loop; what grows with depth is
    # the stacked copy of the layers' sharded weights (1/8 of a layer each) and of their
    # gradients, and the stored layer inputs: measured 0.93 MB per layer, under a third of
    # a gathered layer.
    assert temp["True/6"] - temp["True/2"] < 4 * one_layer_gathered / 2, temp


@pytest.mark.parametrize("layout", list(MESHES))
def test_parameters_are_global_arrays_split_per_plan(layout):
    _, model, opt, step = _train(MESHES[layout])
    plan = sharding_plan(LLAMA)
    for name, p in model.named_parameters():
        buffer = storage_of(p).buffer
        assert len(buffer.sharding.device_set) == 8, name
        expected = plan.sharding_for(name, tuple(p.shape), step.settings.mesh)
        assert buffer.sharding == flat_storage_sharding(expected), name
        # Split as many ways as the plan splits the natural-shape parameter (distinct blocks).
        blocks = expected.devices_indices_map(tuple(p.shape)).values()
        ways = len({repr(index) for index in blocks})
        if p.dim() == 2:  # every Llama weight matrix is split at least over fsdp
            assert ways > 1, name
        assert buffer.addressable_shards[0].data.size == p.numel() // ways, name
        for key in ("exp_avg", "exp_avg_sq"):
            assert storage_of(opt.state[p][key]).buffer.sharding == buffer.sharding, (name, key)
    wq = storage_of(model.layers[0].attention.wq.weight).buffer.sharding
    # Column-parallel under TP x FSDP: split over both axes.
    if layout == "tp2_fsdp4":
        assert tuple(wq.spec[0]) == ("tensor", "fsdp")


def test_fsdp8_divides_parameter_and_state_memory():
    _, ref_model, ref_opt, _ = _train(None)
    _, model, opt, _ = _train(MESHES["fsdp8"])
    one = storage_bytes_per_device(_trained_tensors(ref_model, ref_opt))
    assert len(one) == 1
    total = next(iter(one.values()))
    per_device = storage_bytes_per_device(_trained_tensors(model, opt))
    assert len(per_device) == 8
    for device, nbytes in per_device.items():
        assert nbytes == pytest.approx(total / 8, rel=0.01), device


def test_activations_are_pinned_by_the_plans_rule():
    # The Llama plan's activation rule pins intermediates by shape: the batch split over
    # (data, fsdp, expert), attention heads and feed-forward units over tensor (the lowered program
    # shows the constraints; the losses above show they change no value).
    *_, step = _train(MESHES["tp2_fsdp4"])
    (program,) = step.cache.entries.values()
    constraints = re.findall(r"sharding_constraint %\w+ <@\w+, (\[[^\]]*\])> : tensor<([\dx]+)x",
                             program.lowered.as_text())
    batch, seq = _batches()[0]["tokens"].shape
    specs = {spec for spec, _ in constraints}
    heads = f"{batch}x{CFG.n_heads}x{seq}"
    assert any(shape.startswith(heads) for _, shape in constraints), constraints[:5]
    batch_axes = '{"data", "fsdp", "expert"}'
    assert f'[{batch_axes}, {{"tensor"}}, {{?}}, {{?}}]' in specs  # [batch, heads, seq, hd]
    assert f'[{batch_axes}, {{?}}, {{"tensor"}}]' in specs  # [batch, seq, ffn or vocab]


def test_mesh_without_plan_is_an_error():
    model = copy.deepcopy(_base()).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mesh = build_mesh(1, 8, 1, split_sizes=LLAMA.split_sizes(CFG))
    step = compile_train_step(model, opt, _loss, mesh=mesh)
    batch = {k: v.to(DEVICE) for k, v in _batches()[0].items()}
    with pytest.raises(ValueError, match="both mesh= and plan="):
        step(batch)


def test_jax_devices_are_the_virtual_eight():
    # The SPMD tests above are only meaningful with several devices.
    assert len(jax.devices()) == 8
