"""Fused eager mode: ops are recorded and run as one program when a value is needed.

The aliasing suite and the training tests run in both modes (test_aliasing.py,
test_training.py); these tests check the mode itself: what runs a region, that nothing runs
before, and that results equal strict mode's.
"""

import pytest
import torch

import tpu_train
from tpu_train.device import lazy, op_cache, runtime, storage_of
from tests.tolerances import SAFETY, function_ulps, rounding_ulps, unit_roundoff


def _counts():
    return lazy.stats()


def _ran_since(before):
    return _counts()["regions_run"] - before["regions_run"]


def test_eager_mode_switches_and_restores_the_mode():
    assert lazy.mode() == "strict"
    with tpu_train.eager_mode("fused"):
        assert lazy.mode() == "fused"
        with tpu_train.eager_mode("debug"):
            assert lazy.mode() == "debug" and op_cache._sync
        assert lazy.mode() == "fused" and not op_cache._sync
    assert lazy.mode() == "strict"


def test_unknown_modes_are_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="unknown tpu eager mode 'lazy'; choose one of strict"):
        with tpu_train.eager_mode("lazy"):
            pass
    monkeypatch.setenv(lazy.MODE_ENV, "Fused")
    assert lazy.mode_from_environment() == "fused"
    monkeypatch.setenv(lazy.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="TPU_TRAIN_EAGER_MODE='fast' is not an eager mode"):
        lazy.mode_from_environment()


def _chain(x):
    y = torch.sin(x) * 2 + 1
    y.mul_(x)
    return y.sum(dim=0)


@pytest.mark.parametrize("read", ["item", "cpu", "repr", "python_if", "synchronize", "exit"])
def test_a_value_read_runs_the_region_and_nothing_runs_before(read):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).to("tpu")
    expected = _chain(x.cpu())
    with tpu_train.eager_mode("fused"):
        before = _counts()
        y = _chain(x)
        assert _counts()["ops_recorded"] - before["ops_recorded"] >= 4
        assert _ran_since(before) == 0
        if read == "item":
            y[0].item()
        elif read == "cpu":
            y.cpu()
        elif read == "repr":
            repr(y)
        elif read == "python_if":
            if y[0] > 0:
                pass
        elif read == "synchronize":
            torch.tpu.synchronize()
    assert _ran_since(before) == 1
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-6, atol=0)


@pytest.mark.devices(2)
def test_factories_are_recorded_and_a_host_copy_into_a_fresh_tensor_runs_nothing():
    host = torch.arange(6, dtype=torch.float32)
    with tpu_train.eager_mode("fused"):
        before = _counts()
        zeros = torch.zeros(2, 3, device="tpu")
        full = torch.full((4,), 2.5, device="tpu")
        on_one = torch.full((3,), 7, device="tpu:1")  # a region of fills only
        copied = host.to("tpu")  # torch.empty, filled only if read, then replaced whole
        liked = torch.full_like(zeros, 4.0)  # one fill: the source is not read
        assert _counts()["ops_recorded"] - before["ops_recorded"] == 4  # the four fills
        assert _ran_since(before) == 0
    assert zeros.cpu().tolist() == [[0.0] * 3] * 2 and full.cpu().tolist() == [2.5] * 4
    assert liked.cpu().tolist() == [[4.0] * 3] * 2
    assert storage_of(on_one).buffer.devices() == {runtime.jax_device(1)}
    assert on_one.cpu().tolist() == [7] * 3
    assert torch.equal(copied.cpu(), host)


def test_a_region_runs_when_it_reaches_its_bounded_size(monkeypatch):
    monkeypatch.setenv(lazy.MAX_OPS_ENV, "5")
    x = torch.ones(4, device="tpu")
    with tpu_train.eager_mode("fused"):
        before = _counts()
        for _ in range(12):
            x = x + 1
        assert _ran_since(before) == 2  # the first 5 ops when the 6th comes, then 5 more
    assert float(x.sum()) == 4 * 13


def test_a_bad_region_size_is_refused(monkeypatch):
    monkeypatch.setenv(lazy.MAX_OPS_ENV, "many")
    with pytest.raises(lazy.EagerModeError, match="TPU_TRAIN_FUSED_MAX_OPS=.many. is not a whole number"):
        lazy.set_mode("fused")
    assert lazy.mode() == "strict"


def test_a_loop_compiles_its_region_once():
    x = torch.randn(8, 8).to("tpu")
    w = torch.randn(8, 8).to("tpu")
    with tpu_train.eager_mode("fused"):
        compiled = []
        for _ in range(4):
            w = w - 0.1 * torch.tanh(x @ w)
            w.sum().item()
            compiled.append(_counts()["programs_compiled"])
    assert compiled[1] == compiled[2] == compiled[3]


def test_backward_is_recorded_from_the_autograd_thread():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    reference = [p.detach().clone() for p in model.parameters()]
    model.to("tpu")
    x = torch.randn(4, 6)
    with tpu_train.eager_mode("fused"):
        loss = model(x.to("tpu")).square().mean()
        before = _counts()
        loss.backward()
        assert _counts()["ops_recorded"] > before["ops_recorded"]
        assert _ran_since(before) == 0
        grads = [p.grad.cpu() for p in model.parameters()]
    cpu = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    with torch.no_grad():
        for p, r in zip(cpu.parameters(), reference):
            p.copy_(r)
    cpu(x).square().mean().backward()
    bounds = _gradient_bounds(x, *reference)
    for got, p, bound, name in zip(grads, cpu.parameters(), bounds, ("W1", "b1", "W2", "b2")):
        excess = ((got - p.grad).double().abs() / bound).max().item()
        assert excess <= 1, f"{name}: gradient difference {excess:.2f} x its bound"


def _gradient_bounds(x, w1, b1, w2, b2):
    """Elementwise bounds on how far the gradients of mean((tanh(x W1^T + b1) W2^T + b2)^2) on
    the test platform may be from PyTorch's on CPU, propagated to first order through the
    forward and backward (tests/tolerances.py): tanh within k u (1 + |y|) of torch's (k its
    measured ulps on the platform), each rounded operation r u (a reduction of n, n of them)."""
    u, r, k = unit_roundoff(torch.float32), rounding_ulps(torch.float32), function_ulps("tanh")
    x, w1, b1, w2, b2 = (t.double() for t in (x, w1, b1, w2, b2))
    y = torch.tanh(x @ w1.T + b1)
    out = y @ w2.T + b2
    dout = out / 2  # d mean(out^2) / d out over 4 rows
    dy = dout @ w2
    dz = dy * (1 - y ** 2)
    ax, aw1, aw2, ay, adout, adz = (t.abs() for t in (x, w1, w2, y, dout, dz))
    e_y = k * u * (1 + ay) + (1 - y ** 2) * 7 * r * u * (ax @ aw1.T + b1.abs())
    e_dout = (e_y @ aw2.T + 6 * r * u * (ay @ aw2.T + b2.abs())) / 2 + 2 * r * u * adout
    e_dz = ((e_dout @ aw2 + r * u * adout @ aw2) * (1 - y ** 2) + dy.abs() * 2 * ay * e_y
            + 2 * r * u * adz)
    e_w1 = e_dz.T @ ax + 4 * r * u * adz.T @ ax
    e_b1 = e_dz.sum(0) + 4 * r * u * adz.sum(0)
    e_w2 = e_dout.T @ ay + adout.T @ e_y + 4 * r * u * adout.T @ ay
    e_b2 = e_dout.sum(0) + 4 * r * u * adout.sum(0)
    return [SAFETY * e for e in (e_w1, e_b1, e_w2, e_b2)]


def test_random_ops_draw_the_same_values_as_in_strict_mode():
    x = torch.ones(64, 64, device="tpu")
    results = {}
    for mode in ("strict", "fused"):
        torch.manual_seed(3)
        with tpu_train.eager_mode(mode):
            mask = torch.nn.functional.dropout(x, 0.5)
            noise = torch.randn(64, 64, device="tpu") * 2 + 1
            results[mode] = mask.cpu(), noise.cpu()
    assert torch.equal(results["strict"][0], results["fused"][0])
    # The same draws; XLA may fuse the scaling into the sampling and round differently.
    torch.testing.assert_close(results["strict"][1], results["fused"][1], rtol=1e-6, atol=1e-6)
    assert results["strict"][1].std() > 1.5


def test_ops_that_need_values_run_as_in_strict_mode():
    x = torch.tensor([0.0, 3.0, 0.0, 5.0]).to("tpu")
    with tpu_train.eager_mode("fused"):
        y = x * 2
        nonzero = torch.nonzero(y)  # result shape depends on y's values: y's region runs first
        z = y[nonzero.squeeze(1)] + 1
    assert z.cpu().tolist() == [7.0, 11.0]


@pytest.mark.devices(2)
def test_values_cross_devices_and_regions():
    with tpu_train.eager_mode("fused"):
        a = torch.arange(6.0, device="tpu:0") * 3
        b = a.to("tpu:1") + 1
        c = b * torch.ones(6, device="tpu:1")
    assert c.device == torch.device("tpu", 1)
    assert c.cpu().tolist() == [3.0 * i + 1 for i in range(6)]


def test_overwritten_buffers_are_donated_and_held_ones_are_not():
    w = torch.ones(256, device="tpu")
    other = torch.ones(256, device="tpu")
    held = storage_of(other).buffer  # the caller still holds other's buffer
    with tpu_train.eager_mode("fused"):
        before = _counts()["inputs_donated"]
        for _ in range(3):
            w.mul_(2)
            other.add_(w)
            w.sum().item()
        assert _counts()["inputs_donated"] - before >= 3  # w's old buffer, each step
    assert not held.is_deleted()
    assert float(held.sum()) == 256
    assert w.cpu().tolist() == [8.0] * 256
    assert other.cpu().tolist() == [1.0 + 2 + 4 + 8] * 256


def test_equal_scalars_share_an_input_and_distinct_ones_stay_apart():
    x = torch.ones(3, device="tpu")
    with tpu_train.eager_mode("fused"):
        zero, negative_zero = x * 0.0, x * -0.0
        lr_a, lr_b, nan = x * 0.1, x * 0.1, x * float("nan")
        step = torch.tensor(3.0)  # a 0-dim CPU tensor, as torch.optim's step count
        scaled = x * step
    assert not torch.signbit(zero.cpu()).any() and torch.signbit(negative_zero.cpu()).all()
    assert torch.equal(lr_a.cpu(), lr_b.cpu()) and torch.isnan(nan.cpu()).all()
    assert scaled.cpu().tolist() == [3.0] * 3


def test_a_failing_region_fails_every_read_of_its_results(monkeypatch):
    def failing_program(ops, live, donate, device, rounded_per_op):
        def run(*inputs):
            raise ValueError("out of device memory")
        return run

    x = torch.ones(4, device="tpu")
    x.cpu()  # run before the patch where strict mode records too
    monkeypatch.setattr(lazy, "_program", failing_program)
    with tpu_train.eager_mode("fused"):
        y = (x + 1) * 3
        for _ in range(2):
            with pytest.raises(RuntimeError, match="tpu region of 2 recorded ops failed when "
                                                   "it ran: out of device memory"):
                y.cpu()
    monkeypatch.undo()
    assert (x + 1).cpu().tolist() == [2.0] * 4  # the device goes on working


def test_a_transformers_llama_trains_and_evaluates_in_fused_mode_like_cpu():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    cpu_model = transformers.LlamaForCausalLM(config)
    tpu_model = transformers.LlamaForCausalLM(config)
    tpu_model.load_state_dict(cpu_model.state_dict())
    tpu_model.to("tpu")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = {}
    for name, model, device in (("cpu", cpu_model, "cpu"), ("tpu", tpu_model, "tpu")):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batch = ids.to(device)
        with tpu_train.eager_mode("fused" if device == "tpu" else "strict"):
            model.train()
            losses[name] = []
            for _ in range(3):
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[name].append(loss.item())
            model.eval()
            with torch.no_grad():
                losses[name + "_eval_logits"] = model(input_ids=batch).logits.cpu()
    torch.testing.assert_close(torch.tensor(losses["tpu"]), torch.tensor(losses["cpu"]),
                               rtol=1e-5, atol=0)
    # After 3 AdamW steps (lr 1e-2: each update ~lr whatever the gradient's size) the weights
    # differ by float32 rounding of those updates; the logits show it at ~2e-5.
    torch.testing.assert_close(losses["tpu_eval_logits"], losses["cpu_eval_logits"],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.devices(2)
def test_an_op_on_a_tensor_sharded_over_devices_runs_alone():
    """A region is one program on one device: an op reading a tensor sharded over a mesh (data
    parallelism in one process) is not recorded but runs alone, its Python numbers placed by
    JAX."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array([runtime.jax_device(i) for i in range(2)])
    sharding = NamedSharding(Mesh(devices, ("x",)), PartitionSpec("x"))
    x = torch.linspace(-2, 2, 8)
    sharded = x.to("tpu")
    storage_of(sharded).buffer = jax.device_put(storage_of(sharded).buffer, sharding)
    with tpu_train.eager_mode("fused"):
        before = _counts()
        got = [sharded * 0.7, sharded.clone().mul_(0.7), sharded * 2 - 1]
        assert _counts()["ops_recorded"] == before["ops_recorded"]
    for a, b in zip(got, [x * 0.7, x * 0.7, x * 2 - 1]):
        torch.testing.assert_close(a.cpu(), b, atol=0, rtol=0)
