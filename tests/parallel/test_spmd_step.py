"""A sharded training step equals the single-device one; FSDP divides per-device memory.

The step is the hand-written JAX Llama (``tests/parallel/jax_reference.py``) under the Llama
plan, on the 8 virtual CPU devices of the test session.
"""

import functools

import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding

from tpu_train.models import LLAMA, get_config
from tpu_train.parallel import build_mesh, sharding_plan, per_device_bytes
from tests.parallel import jax_reference as ref

from tests.tolerances import loss_rtol, param_atol

# Meshes over the session's 8 virtual devices.
pytestmark = pytest.mark.devices(8)

CFG = get_config("debug_tiny", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256,
                 ffn_hidden_dim=128)
STEPS = 3
LR = 1e-3  # make_train_step's default AdamW learning rate
# Float32 (tests/tolerances.py): longest reduction the vocabulary 256 (dim 64, SwiGLU 128,
# 8 x 16 tokens); a sharded sum only changes its order. Losses within loss_rtol(STEPS),
# parameters within an RMS bound relative to the total AdamW update LR * STEPS.
N = 256
F32 = torch.float32
REL = loss_rtol(F32, STEPS, N)


def _batch():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CFG.vocab_size, (8, 16)).astype(np.int32)
    labels = rng.integers(0, CFG.vocab_size, (8, 16)).astype(np.int32)
    return tokens, labels


@functools.lru_cache(maxsize=None)
def _train_on(degrees):
    """``_train`` on a mesh of these degrees (None: one device), once per test session."""
    return _train(None if degrees is None
                  else build_mesh(*degrees, split_sizes=LLAMA.split_sizes(CFG)))


def _train(mesh):
    """Losses of STEPS AdamW steps, and the final parameters and optimizer state."""
    host = ref.init_params(CFG, seed=0)
    tokens, labels = _batch()
    plan = sharding_plan(LLAMA)
    if mesh is None:
        params = {n: jax.device_put(v, jax.devices()[0]) for n, v in host.items()}
        step = ref.make_train_step(CFG)
    else:
        params = plan.place(host, mesh)
        step = ref.make_train_step(CFG, mesh, plan)
        batch_sharding = NamedSharding(mesh, plan.activation("tokens"))
        tokens = jax.device_put(tokens, batch_sharding)
        labels = jax.device_put(labels, batch_sharding)
    opt = ref.adamw_init(params)  # zeros_like keeps each parameter's sharding
    losses = []
    for _ in range(STEPS):
        params, opt, loss = step(params, opt, tokens, labels)
        losses.append(float(loss))
    return losses, params, opt


@pytest.fixture(scope="module")
def single_device():
    return _train_on(None)


@pytest.mark.parametrize("degrees", [(1, 8, 1), (1, 4, 2), (2, 2, 2)],
                         ids=["fsdp8", "fsdp4_tp2", "dp2_fsdp2_tp2"])
def test_sharded_step_matches_one_device(single_device, degrees):
    want, want_params, _ = single_device
    got, params, opt = _train_on(degrees)
    for a, b in zip(got, want):
        assert abs(a - b) <= REL * abs(b), (got, want)
    assert want[-1] < want[0]  # it trains: the comparison is not between constants
    for name, value in params.items():
        assert value.sharding.spec == sharding_plan(LLAMA).spec_for(name)  # outputs keep the plan
        got_value, want_value = np.asarray(value, np.float64), np.asarray(want_params[name],
                                                                        np.float64)
        rms = float(np.sqrt(np.mean((got_value - want_value) ** 2)))
        bound = param_atol(F32, LR, STEPS, reduction=N, numel=want_value.size)
        assert rms <= bound, f"{name}: RMS difference {rms:.2e} > {bound:.2e}"
    assert opt["exp_avg"]["output.weight"].sharding == params["output.weight"].sharding


def test_fsdp8_holds_an_eighth_of_params_and_optimizer_state(single_device):
    _, params1, opt1 = single_device
    _, params8, opt8 = _train_on((1, 8, 1))
    one = per_device_bytes([params1, opt1["exp_avg"], opt1["exp_avg_sq"]])
    assert len(one) == 1
    full = next(iter(one.values()))
    eight = per_device_bytes([params8, opt8["exp_avg"], opt8["exp_avg_sq"]])
    assert len(eight) == 8
    for device, nbytes in eight.items():
        assert nbytes == pytest.approx(full / 8, rel=0.01), device
