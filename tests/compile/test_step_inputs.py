"""What a compiled step reads on each call: cached inputs that follow the user's objects, the
natural-shape layout a TPU uses, and bf16 compute."""

from __future__ import annotations

import copy
import dataclasses
import re
import weakref

import jax
import numpy as np
import pytest
import torch

from tests import tolerances
from tests.compile.helpers import (DEVICE, MLP_FUNCTIONS, MLP_N, assert_params_within, lm_batches,
                                   lm_loss, mlp, mlp_batches, mlp_loss, tiny_llama, to_device)
from tests.compile.test_autocast import _dot_dtypes
from tests.tolerances import loss_rtol
from tpu_train.compile import compile_train_step
from tpu_train.device import runtime
from tpu_train.device.tensor import storage_of


def _losses(step, batches):
    return [float(step(b)["loss"]) for b in batches]


def test_a_replaced_buffer_and_a_loaded_optimizer_state_are_read():
    """The step keeps what it collected between calls; what the user replaces is seen."""
    model = mlp().to(DEVICE)
    model.register_buffer("shift", torch.zeros(4, device=DEVICE))

    def loss_fn(m, batch):
        return mlp_loss(m, batch) + m.shift.sum()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = compile_train_step(model, opt, loss_fn)
    batch = to_device(mlp_batches(1)[0])
    first = float(step(batch)["loss"])
    saved = copy.deepcopy(opt.state_dict())
    second = float(step(batch)["loss"])
    model.shift = torch.full((4,), 1.0, device=DEVICE)  # a new buffer object
    assert float(step(batch)["loss"]) > second + 3.5  # the new buffer's sum (4.0) is added
    model.shift = torch.zeros(4, device=DEVICE)
    opt.load_state_dict(saved)  # new state tensors, the step count back to 1
    assert opt.state[next(iter(model.parameters()))]["step"].item() == 1
    step(batch)
    assert opt.state[next(iter(model.parameters()))]["step"].item() == 2
    assert np.isfinite(first)


def test_freezing_a_parameter_recompiles_without_it():
    model = mlp().to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compile_train_step(model, opt, mlp_loss)
    batch = to_device(mlp_batches(1)[0])
    step(batch)
    frozen = next(iter(model.parameters()))
    before = frozen.detach().cpu().clone()
    frozen.requires_grad_(False)
    step(batch)
    assert len(step.compilations) == 2
    assert torch.equal(frozen.detach().cpu(), before)


def test_natural_layout_trains_like_the_flat_one(monkeypatch):
    """The layout a TPU uses (parameters and optimizer state in their own shapes, not flat),
    forced on the CPU client: same losses, and the tensors stay usable eagerly."""
    batches = [to_device(b) for b in lm_batches(3)]
    reference = tiny_llama().to(DEVICE)
    model = copy.deepcopy(reference)
    flat = _losses(compile_train_step(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3),
                                      lm_loss), batches)
    monkeypatch.setattr(runtime, "natural_buffers", lambda platform: True)
    step = compile_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), lm_loss)
    natural = _losses(step, batches)
    np.testing.assert_allclose(natural, flat, rtol=1e-5)
    weight = model.layers[0].attention.wq.weight
    assert storage_of(weight).shaped(tuple(weight.shape)).shape == tuple(weight.shape)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-4, atol=1e-6,
                                   msg=name)
    # An eager op reads a parameter the step left in its natural shape (flattened once).
    assert torch.allclose((weight * 2).sum().cpu(), 2 * weight.detach().cpu().sum(), rtol=1e-5)


def test_bf16_compute_runs_every_product_in_bf16_and_tracks_float32():
    batches = [to_device(b) for b in lm_batches(2)]
    fp32_model = tiny_llama().to(DEVICE)
    bf16_model = copy.deepcopy(fp32_model)
    fp32 = compile_train_step(fp32_model, torch.optim.AdamW(fp32_model.parameters(), lr=3e-3),
                              lm_loss)
    bf16 = compile_train_step(bf16_model, torch.optim.AdamW(bf16_model.parameters(), lr=3e-3),
                              lm_loss, compute_dtype=torch.bfloat16)
    steps = 12
    a = np.array([float(fp32(batches[i % 2])["loss"]) for i in range(steps)])
    b = np.array([float(bf16(batches[i % 2])["loss"]) for i in range(steps)])
    assert a[-1] < 0.8 * a[0], a
    # bf16 activations (not only products) rounded once per op: a few roundings per layer.
    assert (np.abs(b - a) / a).max() < loss_rtol(torch.bfloat16, 1, 1, depth=6), (a, b)
    assert _dot_dtypes(bf16) == {"bf16"}
    assert all(p.dtype == torch.float32 for p in bf16_model.parameters())
    assert all(s.dtype == torch.float32 for st in bf16.optimizer.state.values()
               for s in st.values() if s.is_floating_point())


def _table_conversions_and_scatters(model, vocab: int, dim: int) -> tuple[int, list]:
    """In the bf16-compute step's lowered program: how many converts of a whole float32
    ``[vocab, dim]`` weight to bf16, and the element types of ``[vocab, dim]`` scatters (the
    embedding gradient)."""
    from tpu_train.compile import lower_train_step

    tokens = torch.zeros(2, 16, dtype=torch.long)
    program = lower_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), lm_loss,
                               to_device({"tokens": tokens, "labels": tokens}),
                               compute_dtype=torch.bfloat16, compile=False)
    lines = program.lowered.as_text().splitlines()
    table = f"tensor<{vocab}x{dim}x"
    conversions = sum(1 for line in lines if "stablehlo.convert" in line
                      and f"({table}f32>) -> {table}bf16>" in line)
    scatters = []
    for k, line in enumerate(lines):
        if '"stablehlo.scatter"' in line:
            end = next(rest for rest in lines[k:] if rest.strip().startswith("})"))
            scatters.append(re.search(r"-> tensor<(?:\d+x)+(\w+)>", end).group(1))
    return conversions, scatters


def test_bf16_compute_gathers_embedding_rows_before_casting():
    """Only the gathered rows of an embedding table are cast to the compute dtype (as a JAX
    user writes it), and its gradient is summed in float32, as PyTorch's embedding backward
    does; a table that a product also reads (tied embeddings) is cast whole, as every other
    weight, once."""
    untied = tiny_llama().to(DEVICE)
    vocab, dim = untied.tok_embeddings.weight.shape
    # One conversion: the output projection's weight (read by two products), not the table.
    assert _table_conversions_and_scatters(untied, vocab, dim) == (1, ["f32"])
    from tpu_train.models import Llama

    tied = Llama(dataclasses.replace(untied.config, tie_embeddings=True))
    tied.init_weights(seed=0, device="cpu")
    assert _table_conversions_and_scatters(tied.to(DEVICE), vocab, dim) == (1, ["bf16"])


def test_bad_compute_dtype_is_one_clear_error():
    model = mlp().to(DEVICE)
    with pytest.raises(ValueError, match="compute_dtype must be"):
        compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_loss,
                           compute_dtype=torch.int8)


def _mlp_step(lr=1e-2):
    model = mlp().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt, compile_train_step(model, opt, mlp_loss)


def test_weights_written_eagerly_between_calls_are_read():
    """A call reuses the previous call's outputs as inputs only while the storages still hold
    them: an eager in-place write, a ``.data`` swap and a ``set_`` in between are all seen.
    Oracle: with every weight zero the MLP outputs its zeroed biases, so the loss is the
    batch's own mean of y squared."""
    batch = to_device(mlp_batches(1)[0])
    zero_output = float((mlp_batches(1)[0]["y"] ** 2).mean())
    for change in ("in place", "data", "set_"):
        model, _, step = _mlp_step()
        step(batch)
        step(batch)
        with torch.no_grad():
            for p in model.parameters():
                if change == "in place":
                    p.zero_()
                elif change == "data":
                    p.data = torch.zeros(p.shape, device=DEVICE)
                else:
                    p.set_(torch.zeros(p.shape, device=DEVICE))
        assert float(step(batch)["loss"]) == pytest.approx(zero_output, rel=1e-6), change
        assert len(step.compilations) == 1, change


def test_step_counters_written_between_calls_are_read():
    """The counters are read on every call (through views of their memory): a counter set by
    hand drives the next bias correction, and the call advances it from there."""
    batch = to_device(mlp_batches(1)[0])
    model, opt, step = _mlp_step()
    step(batch)
    reference_model = copy.deepcopy(model)
    reference_opt = torch.optim.AdamW(reference_model.parameters(), lr=1e-2)
    reference_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # nothing shared
    for state in list(opt.state.values()) + list(reference_opt.state.values()):
        state["step"].fill_(40.0)
    step(batch)
    loss = mlp_loss(reference_model, batch)  # the same update in eager torch
    loss.backward()
    reference_opt.step()
    assert {s["step"].item() for s in opt.state.values()} == {41.0}
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-5, atol=1e-6)


def _train_then_evaluate(natural: bool, monkeypatch) -> tuple:
    """Two steps of a tiny Llama, then compiled validation (loss and greedy decoding) and a
    third step, in the flat or the natural (a TPU's) layout; the last step's loss, the
    validation's figures, and whether a parameter's buffer came through validation as the
    step left it."""
    from tpu_train.compile.decoding import CompiledDecoder
    from tpu_train.compile.evaluation import CompiledLoss
    from tpu_train.models.generation import StaticCacheDecoding

    torch.manual_seed(0)
    model = tiny_llama().to(DEVICE)
    if natural:
        monkeypatch.setattr(runtime, "natural_buffers", lambda platform: True)
    step = compile_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), lm_loss)
    batches = lm_batches(3)
    _losses(step, [to_device(b) for b in batches[:2]])
    weight = model.layers[0].feed_forward.w1.weight
    before = storage_of(weight).shaped(tuple(weight.shape))
    loss = CompiledLoss(model, lm_loss)(batches[2])
    tokens = CompiledDecoder(model, StaticCacheDecoding()).generate(
        [[1, 2, 3], [4, 5, 6, 7, 8]], 6)
    kept = storage_of(weight).shaped(tuple(weight.shape)) is before
    return _losses(step, [to_device(batches[2])]), loss, tokens, kept


def test_validation_reads_the_natural_layout_as_the_step_left_it(monkeypatch):
    """Compiled validation (loss, decoding) takes each parameter as the train step keeps it:
    in its own shape on a TPU (forced here on the CPU client), so that a buffer is not
    flattened for validation and reshaped again by the next step (on a TPU, a copy and a
    program per shape each way). Same figures as the flat layout."""
    flat = _train_then_evaluate(False, monkeypatch)
    natural = _train_then_evaluate(True, monkeypatch)
    assert natural[3], "validation replaced the step's natural-shape buffer"
    assert natural[2].tolist() == flat[2].tolist()
    np.testing.assert_allclose(natural[1], flat[1], rtol=1e-5)
    np.testing.assert_allclose(natural[0], flat[0], rtol=1e-5)


def test_a_step_that_skips_non_finite_updates_does_not_wait_for_its_flag(monkeypatch):
    """The call reads no flag of its own: the device runs the program while the host goes on
    (on a chip, a wait in the call costs a round trip of its own before the loop reads the
    loss). The flag is read when the step counts are next needed, here the optimizer's
    ``state_dict()``, and by then the arrays the call donated are freed (docs/compile.md)."""
    from tpu_train.compile import train_step as train_step_module

    model = mlp().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = compile_train_step(model, opt, mlp_loss, skip_non_finite=True)
    batch = to_device(mlp_batches(1)[0])
    step(batch)  # compiles; the storages now hold the program's outputs, the next inputs
    donated = [weakref.ref(storage_of(t).buffer)
               for t in [*model.parameters(), *(v for s in opt.state.values()
                                                for v in s.values() if v.device == DEVICE)]]
    reads = []
    read_finite = train_step_module.read_finite

    def read(metrics):
        reads.append((metrics, sum(ref() is not None for ref in donated)))
        return read_finite(metrics)

    monkeypatch.setattr(train_step_module, "read_finite", read)
    out = step(batch)
    metrics = storage_of(out["finite"]).buffer
    assert all(read_metrics is not metrics for read_metrics, _ in reads)  # the first call's
    assert float(out["finite"]) == 1.0
    opt.state_dict()
    assert [alive for read_metrics, alive in reads if read_metrics is metrics] == [0]
    assert len(donated) > 4


def test_a_tpu_batch_goes_in_as_stored_and_trains_as_a_host_batch():
    """A batch moved with ``.to("tpu")`` keeps the buffers ``.to`` gave it: flat on the CPU
    client, in the tensors' own shapes where the platform keeps natural buffers (a TPU:
    ``runtime.natural_buffers``). The program takes them as they are and reshapes a flat one
    inside, so no reshape program runs for each leaf before each call (the storage still holds
    the same buffer afterwards). Its steps equal a host batch's; a slice of a larger storage
    is read as a view, and the same again."""
    batches = lm_batches(3)

    def run(place):
        model = tiny_llama()
        step = compile_train_step(model.to(DEVICE), torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  lm_loss)
        placed = [place(b) for b in batches]
        losses = _losses(step, placed)
        return losses, placed, step

    host, _, _ = run(lambda b: b)
    flat, placed, step = run(to_device)
    assert flat == host
    natural = runtime.natural_buffers(runtime.platform())
    assert [tuple(storage_of(t).as_stored().shape) for b in placed for t in b.values()] == \
        [tuple(t.shape) if natural else (t.numel(),) for b in placed for t in b.values()]
    (signature,) = step.cache.entries
    (spec,) = [s for s in signature.inputs if "tokens" in s.name]
    # The stored shape is named only where it is not the tensor's (the program reshapes it).
    assert spec.shape == (2, 32) and spec.stored == (None if natural else (64,))

    def halves(b):  # each leaf half of one storage: read as a view
        whole = torch.cat([b["tokens"], b["labels"]]).to(DEVICE)
        return {"tokens": whole[:2], "labels": whole[2:]}

    sliced, _, _ = run(halves)
    assert sliced == host


def test_the_next_calls_host_scalars_travel_during_the_call_and_a_changed_lr_is_read():
    """A call puts the next call's lr and bias corrections on the device while its program
    runs (a host argument delays a program's start on a TPU); the next call takes them where
    they hold what it computes itself. A scheduler's lr is what travels ahead; an lr set by
    hand between calls goes in from the host. Every update equals eager torch's."""
    model = mlp().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    step = compile_train_step(model, opt, mlp_loss, scheduler=scheduler)
    reference = copy.deepcopy(model).cpu()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_scheduler = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    batches = mlp_batches(4)
    kinds = []
    for i, batch in enumerate(batches):
        if i == 3:  # by hand, after the call that put the scheduler's next lr ahead
            for group in opt.param_groups + ref_opt.param_groups:
                group["lr"] = 0.5
        if i == 1:
            (entry,) = step.cache.entries.values()
            executable = entry.executable

            def recording(*args):
                kinds.append("device" if isinstance(args[4], jax.Array) else "host")
                return executable(*args)

            entry.executable = recording
        step(to_device(batch))
        mlp_loss(reference, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_scheduler.step()
    assert kinds == ["device", "device", "host"]
    # Derived for 4 AdamW steps at the peak lr (0.5): an lr missed by a step moves every
    # element by ~0.5, orders of magnitude past this.
    assert_params_within(model, reference, lambda name, q: tolerances.param_atol(
        torch.float32, 0.5, len(batches), reduction=MLP_N, numel=q.numel(),
        functions=MLP_FUNCTIONS))


def test_put_batch_moves_a_host_batch_to_the_steps_device_for_a_later_call(monkeypatch):
    """``put_batch`` (what the trainer's loop calls for the next batch while a step runs) moves
    host tensors to the device of the step's parameters, one transfer each and no device
    program (neither a fill program nor, where strict mode records every op, a recorded
    fill), as ``.to("tpu")`` of a host tensor, and leaves tpu tensors as they are;
    the steps on batches it placed are one program and equal steps on host batches."""
    from tpu_train.device import lazy
    from tpu_train.device import storage as storage_mod
    from tpu_train.device.tensor import TpuTensor

    def run(place):
        model = mlp().to(DEVICE)
        step = compile_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  mlp_loss)
        placed = [place(step, b) for b in mlp_batches(3)]
        return _losses(step, placed), placed, step

    host, _, _ = run(lambda step, b: b)
    ahead, placed, step = run(lambda step, b: step.put_batch(b))
    assert all(isinstance(t, TpuTensor) and t.device == DEVICE
               for b in placed for t in b.values())
    assert len(step.cache.entries) == 1
    assert ahead == host
    already = to_device(mlp_batches(1)[0])
    assert step.put_batch(already)["x"] is already["x"]

    def no_program(*args):
        raise AssertionError("a device program ran to place a batch")

    monkeypatch.setattr(storage_mod, "_filler", no_program)
    monkeypatch.setattr(lazy.Region, "record", no_program)
    host = mlp_batches(1, seed=7)[0]
    placed = step.put_batch(host)
    assert torch.equal(placed["x"].cpu(), host["x"])
    assert torch.equal(to_device(host)["x"].cpu(), host["x"])  # torch's empty, then a copy

    def fills():  # a fill runs a program (from a size's second at the latest): the hooks see it
        for _ in range(2):
            torch.full((7,), 2.0, device=DEVICE)

    with pytest.raises(AssertionError, match="a device program ran"):
        fills()
