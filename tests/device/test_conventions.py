"""Device conventions a CUDA user relies on, checked against PyTorch on CPU.

Tied parameters stay one parameter (``.to``, ``_apply`` paths, ``load_state_dict``,
``torch.save``/``load``); pinned host memory; ``torch.Generator(device="tpu")``;
``torch.accelerator``; ``torch.profiler``; autocast's default dtype; ``DataLoader`` workers.
"""

import copy
import io
import os
import pickle
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpu_train  # noqa: F401
from tests.device.test_training import _train as train_steps
from tests.distributed.harness import free_port_pair
from tests.tolerances import CROSS_ENTROPY_FUNCTIONS, loss_rtol, param_atol, update_rtol

STEPS = 4


class TiedLM(nn.Module):
    """GPT-2's layout in miniature: the LM head's weight is the token embedding."""

    def __init__(self, vocab=48, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        return self.lm_head(self.norm(F.gelu(self.mix(self.embed(tokens)))))


class SharedLinears(nn.Module):
    """Two Linears sharing one weight (and nothing else)."""

    def __init__(self, dim=12):
        super().__init__()
        self.first = nn.Linear(dim, dim)
        self.second = nn.Linear(dim, dim)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _regression_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def _lm_batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 48, (2, 9), generator=g) for _ in range(STEPS)]


def _regression_batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(6, 12, generator=g), torch.randn(6, 12, generator=g)) for _ in range(STEPS)]


def _to(batch, device):
    return tuple(t.to(device) for t in batch) if isinstance(batch, tuple) else batch.to(device)


LR = {"sgd": 0.1, "adamw": 1e-2}


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=LR["adamw"], weight_decay=0.1),
}


def _train(model, optimizer_name, batches, loss_fn):
    return train_steps(model, OPTIMIZERS[optimizer_name], batches, loss_fn)


def _rms(t):
    return t.detach().double().pow(2).mean().sqrt().item()


def _assert_trains_like_cpu(cpu_model, tpu_model, optimizer_name, batches, loss_fn, functions):
    """``functions``: the elementwise functions along the model and its loss (tests/tolerances
    ``rtol_for``: each adds its measured error)."""
    initial = {name: p.detach().clone() for name, p in cpu_model.named_parameters()}
    expected = _train(cpu_model, optimizer_name, batches, loss_fn)
    got = _train(tpu_model, optimizer_name, [_to(b, "tpu") for b in batches], loss_fn)
    # float32, STEPS steps; the longest reduction is the vocabulary (48) or the width (12).
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected),
                               rtol=loss_rtol(torch.float32, STEPS, 48, functions=functions),
                               atol=0)
    cpu_params = dict(cpu_model.named_parameters())
    tpu_params = dict(tpu_model.named_parameters())
    assert cpu_params.keys() == tpu_params.keys()  # shared ones listed once on both
    for name, p_cpu in cpu_params.items():
        if optimizer_name == "adamw":  # each element moves ~lr per step (tests/tolerances.py)
            limit = param_atol(torch.float32, LR["adamw"], STEPS, reduction=48,
                               numel=p_cpu.numel(), functions=functions)
        else:  # SGD is linear in the gradient: relative to the accumulated update
            limit = (update_rtol(torch.float32, STEPS, 48, functions=functions)
                     * _rms(p_cpu - initial[name]))
        err = _rms(tpu_params[name].cpu() - p_cpu)
        assert err <= limit, f"{name}: RMS difference {err:.2e} > {limit:.2e}"


# The elementwise functions of each model and its loss: TiedLM's GELU, LayerNorm and
# cross-entropy; SharedLinears' tanh (a mean squared error has none).
TIED_LM_FUNCTIONS = ("erf", "rsqrt", *CROSS_ENTROPY_FUNCTIONS)
TIED = {"tied_lm": (TiedLM, _lm_batches, _lm_loss, ("lm_head", "embed"), TIED_LM_FUNCTIONS),
        "shared_linears": (SharedLinears, _regression_batches, _regression_loss,
                           ("second", "first"), ("tanh",))}


def _shared(model, names):
    a, b = (getattr(model, n).weight for n in names)
    return a is b


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
@pytest.mark.parametrize("case", TIED)
def test_tied_parameters_stay_tied_through_to_and_train_like_cpu(case, optimizer_name):
    make, batches, loss_fn, names, functions = TIED[case]
    torch.manual_seed(0)
    cpu_model = make()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    assert _shared(cpu_model, names) and _shared(tpu_model, names)
    assert isinstance(getattr(tpu_model, names[0]).weight, nn.Parameter)
    assert len(list(tpu_model.parameters())) == len(list(cpu_model.parameters()))
    _assert_trains_like_cpu(cpu_model, tpu_model, optimizer_name, batches(), loss_fn, functions)
    assert _shared(tpu_model, names)


def test_tied_parameters_through_other_apply_paths():
    torch.manual_seed(0)
    model = TiedLM()
    assert _shared(model.tpu(), ("lm_head", "embed"))
    assert _shared(model.to(torch.bfloat16), ("lm_head", "embed"))  # tpu -> tpu, new dtype
    assert model.embed.weight.dtype == torch.bfloat16
    empty = TiedLM().to_empty(device="tpu")
    assert _shared(empty, ("lm_head", "embed"))
    back = model.cpu()
    assert _shared(back, ("lm_head", "embed")) and back.embed.weight.device.type == "cpu"


def test_tied_parameters_through_load_state_dict():
    torch.manual_seed(0)
    source = TiedLM()
    target = TiedLM().to("tpu")
    target.load_state_dict(source.state_dict())
    assert _shared(target, ("lm_head", "embed"))
    torch.testing.assert_close(target.embed.weight.cpu(), source.embed.weight, rtol=0, atol=0)
    # and back: a tpu state dict into a CPU model
    back = TiedLM()
    back.load_state_dict(target.state_dict())
    assert _shared(back, ("lm_head", "embed"))
    torch.testing.assert_close(back.lm_head.weight, source.lm_head.weight, rtol=0, atol=0)


def test_tied_parameters_through_save_and_load():
    torch.manual_seed(0)
    cpu_model = TiedLM()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    buffer = io.BytesIO()
    torch.save(tpu_model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert _shared(loaded, ("lm_head", "embed"))
    assert all(isinstance(p, nn.Parameter) and p.device.type == "tpu" for p in loaded.parameters())
    assert len(list(loaded.parameters())) == len(list(cpu_model.parameters()))
    _assert_trains_like_cpu(cpu_model, loaded, "adamw", _lm_batches(), _lm_loss, TIED_LM_FUNCTIONS)
    buffer = io.BytesIO()
    torch.save(loaded.state_dict(), buffer)
    buffer.seek(0)
    fresh = TiedLM().to("tpu")
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert _shared(fresh, ("lm_head", "embed"))
    torch.testing.assert_close(fresh.embed.weight.cpu(), loaded.embed.weight.cpu(), rtol=0, atol=0)


def test_gpt2_tied_head_trains_like_cpu():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=48, n_positions=16, n_embd=16, n_layer=1,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     tie_word_embeddings=True)
    torch.manual_seed(0)
    cpu_model = transformers.GPT2LMHeadModel(config)
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    assert tpu_model.lm_head.weight is tpu_model.transformer.wte.weight

    def loss_fn(model, tokens):
        return model(input_ids=tokens, labels=tokens).loss

    # SGD: attention's key bias has an exactly-zero true gradient (softmax ignores a shift per
    # query), so both sides see rounding noise there, which Adam would scale up to lr per step.
    # GPT-2's elementwise functions: three LayerNorms, the attention softmax, its tanh GELU and
    # the cross-entropy.
    functions = ("rsqrt", "rsqrt", "rsqrt", "exp", "tanh", *CROSS_ENTROPY_FUNCTIONS)
    _assert_trains_like_cpu(cpu_model, tpu_model, "sgd", _lm_batches(), loss_fn, functions)
    assert tpu_model.lm_head.weight is tpu_model.transformer.wte.weight


# -- torch.accelerator ---------------------------------------------------------------------------


def test_accelerator_memory_statistics_follow_allocations():
    assert torch.accelerator.current_accelerator().type == "tpu"
    torch.accelerator.synchronize()
    before = torch.accelerator.memory_allocated()
    x = torch.ones(1000, 25, device="tpu")
    torch.accelerator.synchronize("tpu:0")
    assert torch.accelerator.memory_allocated() - before == x.nbytes
    assert torch.accelerator.memory_allocated(0) == torch.tpu.memory_allocated(0)
    assert torch.accelerator.max_memory_allocated() >= before + x.nbytes
    assert torch.accelerator.memory_stats()["allocated_bytes.all.current"] == before + x.nbytes
    del x
    assert torch.accelerator.memory_allocated() == before
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == before
    torch.accelerator.empty_cache()
    free, total = torch.accelerator.get_memory_info()
    assert 0 < free <= total


def test_allocated_bytes_are_the_tensors_where_pjrt_reports_its_allocator(monkeypatch):
    """A TPU's PJRT allocator counts loaded executables and tiled-layout padding in its
    bytes_in_use, and its peak cannot be reset: allocated stays the tensors' bytes (as on the
    CPU client), PJRT's figure is the reserved one."""
    from tpu_train.device import module, runtime

    class Reporting:
        def __init__(self, device):
            self.device = device

        def memory_stats(self):
            return {"bytes_in_use": 10**9, "peak_bytes_in_use": 2 * 10**9, "bytes_limit": 4 * 10**9}

    before = torch.tpu.memory_allocated(0)
    x = torch.ones(1000, 25, device="tpu:0")
    real = runtime.jax_device
    monkeypatch.setattr(runtime, "jax_device", lambda index: Reporting(real(index)))
    stats = module.memory_stats(0)
    assert stats["allocated_bytes.all.current"] == before + x.nbytes == module.memory_allocated(0)
    assert stats["reserved_bytes.all.current"] == 10**9 and stats["bytes_limit"] == 4 * 10**9
    module.reset_peak_memory_stats(0)
    assert module.max_memory_allocated(0) == before + x.nbytes


def test_torch_profiler_records_tpu_ops():
    """Plain ``torch.profiler`` (host activity) lists the ATen ops run on tpu tensors, with
    their input shapes; the device-side trace is ``tpu_train.compile.profiling.profile``."""
    x = torch.randn(32, 48, device="tpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        torch.relu(x @ x.T).sum().item()
    shapes = {e.name: e.input_shapes for e in prof.events() if e.name.startswith("aten::")}
    assert {"aten::mm", "aten::relu", "aten::sum"} <= shapes.keys(), sorted(shapes)
    assert shapes["aten::mm"][:2] == [[32, 48], [48, 32]]


@pytest.mark.devices(2)
def test_accelerator_device_index_selects_the_tpu_device():
    assert torch.accelerator.device_count() == torch.tpu.device_count() >= 2
    try:
        torch.accelerator.set_device_index(1)
        assert torch.accelerator.current_device_index() == 1 == torch.tpu.current_device()
        assert torch.ones(2, device="tpu").device == torch.device("tpu", 1)
    finally:
        torch.accelerator.set_device_index(0)
    assert torch.ones(2, device="tpu").device == torch.device("tpu", 0)


def test_optimizers_and_clipping_take_their_foreach_paths_by_default_as_on_cuda():
    """torch picks the multi-tensor path for a PrivateUse1 device when the parameters' type is
    foreach-capable; a tpu parameter is one, so AdamW and clip_grad_norm_ run a few _foreach_
    ops for all parameters, not one op chain per parameter, and AdamW still steps like CPU's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    batch = torch.randn(8, 12)
    for model, x in ((cpu_model, batch), (tpu_model, batch.to("tpu"))):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            model(x).square().mean().backward()
            with Names() as seen:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            optimizer.zero_grad()
        foreach = [n for n in seen.names if n.startswith("_foreach_")]
        if x.device.type == "tpu":
            assert "_foreach_norm" in foreach and "_foreach_lerp_" in foreach, seen.names
            assert len(seen.names) < 40, len(seen.names)  # 4 parameters, one list each
        else:  # the CPU oracle keeps torch's CPU default for AdamW: the per-parameter path
            assert "_foreach_lerp_" not in foreach
    for p_cpu, p_tpu in zip(cpu_model.parameters(), tpu_model.parameters()):
        # The gradients pass through the model's tanh: its measured error counts (on a TPU it is
        # 399 u, far above the rounding of these 16-wide reductions).
        limit = param_atol(torch.float32, 1e-2, 3, reduction=16, numel=p_cpu.numel(),
                           functions=("tanh",))
        assert _rms(p_tpu.cpu() - p_cpu) <= limit


# -- autocast ------------------------------------------------------------------------------------


def test_autocast_defaults_to_bfloat16_like_cpu_autocast():
    assert torch.get_autocast_dtype("tpu") == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    with torch.amp.autocast("cpu"):  # CPU autocast's default is bfloat16 too: the oracle
        expected = a @ b
    with torch.amp.autocast("tpu"):
        got = a.to("tpu") @ b.to("tpu")
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu(), expected)


# -- torch.Generator(device="tpu") ---------------------------------------------------------------


def _draws(generator):
    return [torch.randn(6, device="tpu", generator=generator).cpu(),
            torch.empty(5, device="tpu").uniform_(generator=generator).cpu(),
            torch.randint(0, 100, (6,), device="tpu", generator=generator).cpu(),
            torch.bernoulli(torch.full((8,), 0.5, device="tpu"), generator=generator).cpu(),
            torch.multinomial(torch.ones(10, device="tpu"), 4, generator=generator).cpu()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.devices(2)
def test_tpu_generator_seeds_random_ops_like_a_cuda_generator():
    generator = torch.Generator(device="tpu")
    assert isinstance(generator, torch.Generator) and generator.device == torch.device("tpu", 0)
    assert isinstance(torch.default_generator, torch.Generator)  # PyTorch's own stay generators
    assert torch.Generator().device.type == "cpu"
    default_state = torch.tpu.get_rng_state()
    first = _draws(generator.manual_seed(1234))
    assert generator.initial_seed() == 1234
    again = _draws(generator.manual_seed(1234))
    assert _same(first, again)
    assert not _same(first, _draws(generator))  # the stream moves on
    other = _draws(torch.Generator(device="tpu:1").manual_seed(99))
    assert not _same(first, other)
    # a generator's stream is its own: the device's default stream is untouched
    assert torch.equal(torch.tpu.get_rng_state(), default_state)
    assert other[0].shape == (6,) and 0 <= int(other[2].min()) and int(other[2].max()) < 100


def test_tpu_generator_state_round_trips():
    generator = torch.Generator(device="tpu").manual_seed(5)
    state = generator.get_state()
    expected = _draws(generator)
    generator.set_state(state)
    assert _same(_draws(generator), expected)
    generator.set_state(state)
    clone = generator.clone_state()
    copied = pickle.loads(pickle.dumps(generator))
    assert clone.device == copied.device == torch.device("tpu", 0)
    assert _same(_draws(clone), expected) and _same(_draws(copied), expected)


# -- pinned host memory --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_pin_memory_gives_a_pinned_copy(dtype):
    source = (torch.arange(24).view(4, 6) % 5).to(dtype)
    pinned = source.pin_memory()
    assert pinned.is_pinned() and not source.is_pinned()
    assert pinned[1:, 2].is_pinned()  # a view of pinned memory is pinned
    assert pinned.pin_memory() is pinned
    assert pinned.dtype == dtype and torch.equal(pinned, source)
    assert pinned.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    for non_blocking in (False, True):
        moved = pinned.to("tpu", non_blocking=non_blocking)
        assert moved.dtype == dtype and torch.equal(moved.cpu(), source)


def test_copy_from_pinned_memory_is_asynchronous():
    from tpu_train.device import pinned as pinned_memory
    from tpu_train.device.tensor import storage_of

    source = torch.randn(64, 32).pin_memory()
    expected = source.clone()
    gate = threading.Event()
    pinned_memory._transfers.submit(gate.wait)  # hold the transfer thread
    try:
        moved = source.to("tpu", non_blocking=True)  # must return while the thread is held
        assert not storage_of(moved).ready
        blocking = source.to("tpu")  # a blocking copy does not wait for the thread
        unpinned = expected.to("tpu", non_blocking=True)
        assert storage_of(blocking).ready and storage_of(unpinned).ready
    finally:
        gate.set()
    torch.accelerator.synchronize()
    assert storage_of(moved).ready
    assert torch.equal(moved.cpu(), expected) and torch.equal(blocking.cpu(), expected)
    source.zero_()  # after synchronize the pinned buffer may be reused
    assert torch.equal(moved.cpu(), expected)


def test_dataloader_pins_batches_for_the_tpu_device():
    data = torch.utils.data.TensorDataset(torch.arange(20.).view(10, 2), torch.arange(10))
    with pytest.warns(UserWarning, match="pin_memory_device is deprecated"):  # PyTorch's own
        batches = list(torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True,
                                                   pin_memory_device="tpu"))
    for batch in (batches, list(torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True))):
        assert all(t.is_pinned() for pair in batch for t in pair)
        moved = [(x.to("tpu", non_blocking=True), y.to("tpu", non_blocking=True)) for x, y in batch]
        torch.testing.assert_close(torch.cat([x.cpu() for x, _ in moved]), data.tensors[0],
                                   rtol=0, atol=0)
        assert torch.equal(torch.cat([y.cpu() for _, y in moved]), data.tensors[1])


# -- init_device_mesh without init_process_group -------------------------------------------------

_MESH_SCRIPT = """
import sys
import torch, tpu_train
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("tpu", (2,))  # no init_process_group before it
t = torch.ones(3, device="tpu") * (dist.get_rank() + 1)
dist.all_reduce(t, group=mesh.get_group())
# One file per rank: the ranks share the launcher's stdout, where lines can interleave.
with open(f"{sys.argv[1]}/rank{dist.get_rank()}.txt", "w") as out:
    out.write(f"rank {dist.get_rank()} sum {t.cpu().tolist()} device {t.device}")
dist.destroy_process_group()
"""


@pytest.mark.device_in_child
@pytest.mark.multiprocess
def test_init_device_mesh_initialises_the_process_group(tmp_path):
    script = tmp_path / "mesh.py"
    script.write_text(_MESH_SCRIPT)
    port = free_port_pair()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device per process
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(port), str(script), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    for rank in (0, 1):
        written = (tmp_path / f"rank{rank}.txt").read_text()
        assert written == f"rank {rank} sum [3.0, 3.0, 3.0] device tpu:0", written


# -- DataLoader workers --------------------------------------------------------------------------


def test_dataloader_workers_without_fork_warning():
    """JAX warns at every os.fork() once its runtime threads exist (its at-fork hook), and
    DataLoader workers fork by default on Linux. A forkserver (or spawn) context starts the
    workers from a clean process instead: no warning, same batches (docs/architecture.md)."""
    torch.ones(1, device="tpu")  # JAX's threads exist from here on
    data = torch.utils.data.TensorDataset(torch.arange(24.).view(12, 2))
    expected = [b[0] for b in torch.utils.data.DataLoader(data, batch_size=4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2,
                                             multiprocessing_context="forkserver")
        got = [b[0] for b in loader]
    assert not [w for w in caught if "fork" in str(w.message)], [str(w.message) for w in caught]
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and len(got) == len(expected)
