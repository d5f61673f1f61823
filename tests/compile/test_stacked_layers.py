"""A scanned stack's parameters and optimizer state held stacked by the compiled step
(``tpu_train.compile.stacked_layers``).

The oracle is the same step with every tensor passed on its own (the stacked layout planned
away): the same ops on the same values. Only XLA's code for an elementwise op over ``[L, n]``
instead of ``[n]`` may contract a multiply and an add differently, one rounding of float32
(measured on the CPU client: AdamW bitwise equal; SGD's momentum and Adam's parameters and
moments within 4e-7 of each tensor's largest value after 4 steps, losses equal). RTOL bounds
that with room. The torch side sees per-layer
tensors under unchanged names: reading one between steps gives that layer, writing one is
what the next step starts from, a checkpoint written and resumed continues the same run.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from tpu_train.compile import stacked_layers, train_step

from .helpers import DEVICE, OPTIMIZERS, _llama, lm_batches, lm_loss, to_device

LAYERS = 3
STEPS = 4
RTOL = 1e-6  # of each tensor's largest magnitude (module docstring)


def _model():
    torch.manual_seed(0)
    return _llama(dim=64, n_layers=LAYERS, n_heads=4, n_kv_heads=2, vocab_size=128,
                  ffn_hidden_dim=176, max_seq_len=32)


@contextlib.contextmanager
def _per_tensor():
    """The step as it is without stacked storage: every tensor its own argument."""
    planned = stacked_layers.plan_stacks
    stacked_layers.plan_stacks = lambda *args, **kwargs: None
    try:
        yield
    finally:
        stacked_layers.plan_stacks = planned


def _train(optimizer, between=None, **settings):
    """``(metrics, model, optimizer, step)`` of STEPS compiled steps of the scanned tiny
    Llama under ``optimizer`` (a name in OPTIMIZERS, or a factory); ``between(step_index,
    model, optimizer)`` runs after each step."""
    model = _model().to(DEVICE)
    make = OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer
    opt = make(model.parameters())
    step = train_step.compile_train_step(model, opt, lm_loss, max_grad_norm=1.0,
                                         scan_layers=True, **settings)
    metrics = []
    for i, batch in enumerate(lm_batches(STEPS)):
        metrics.append({k: float(v.cpu()) for k, v in step(to_device(batch)).items()})
        if between is not None:
            between(i, model, opt)
    return metrics, model, opt, step


@functools.lru_cache(maxsize=None)
def _pair(optimizer: str, **settings):
    stacked = _train(optimizer, **settings)
    with _per_tensor():
        per_tensor = _train(optimizer, **settings)
    return stacked, per_tensor


def _program(step):
    (program,) = step.cache.entries.values()
    return program


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what) -> None:
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    if expected.numel():
        assert float((actual - expected).abs().max()) <= RTOL * float(expected.abs().max()), what


def _assert_same_training(stacked, per_tensor):
    for metrics, reference in zip(stacked[0], per_tensor[0]):
        assert metrics.keys() == reference.keys()
        assert metrics == pytest.approx(reference, rel=RTOL), (metrics, reference)
    model_state, reference = stacked[1].state_dict(), per_tensor[1].state_dict()
    assert list(model_state) == list(reference)
    for name, value in model_state.items():
        _assert_close(value, reference[name], name)
    opt_state, opt_reference = stacked[2].state_dict(), per_tensor[2].state_dict()
    assert opt_state["param_groups"] == opt_reference["param_groups"]
    assert opt_state["state"].keys() == opt_reference["state"].keys()
    for index, state in opt_reference["state"].items():
        assert opt_state["state"][index].keys() == state.keys()
        for key, value in state.items():
            _assert_close(torch.as_tensor(opt_state["state"][index][key]),
                          torch.as_tensor(value), (index, key))


@pytest.mark.parametrize("settings", [{}, {"skip_non_finite": True}, {"grad_accum_steps": 2}],
                         ids=["plain", "skip_non_finite", "grad_accum"])
def test_stacked_adamw_step_equals_the_per_tensor_step(settings):
    stacked, per_tensor = _pair("adamw", **settings)
    _assert_same_training(stacked, per_tensor)
    layout = _program(stacked[3]).stacking
    # Every slot of the 3 layers (9 tensors each) stacked, with both AdamW moments.
    assert len(layout.param_slots) == 9 and len(layout.state_slots) == 18
    assert all(len(slot) == LAYERS for slot in layout.param_slots + layout.state_slots)
    assert len(layout.loose_params) == 3  # embedding, final norm, head
    assert _program(per_tensor[3]).stacking is None
    # The program takes the stacks: a [3, ...] argument per parameter and moment slot.
    main = _program(stacked[3]).lowered.as_text().split("func.func public @main", 1)[1]
    arguments = main.split(") -> (", 1)[0]
    assert arguments.count("tensor<3x") == 27, arguments


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_other_optimizers_stacked_equal_the_per_tensor_step(optimizer):
    stacked, per_tensor = _pair(optimizer)
    _assert_same_training(stacked, per_tensor)
    layout = _program(stacked[3]).stacking
    state = stacked[2].state[stacked[1].layers[0].attention.wq.weight]
    tensors = [key for key, value in state.items()
               if isinstance(value, torch.Tensor) and value.dim() > 0]
    assert len(layout.state_slots) == 9 * len(tensors), tensors  # momentum; Adam's moments


def test_an_optimizer_whose_step_is_traced_gets_per_layer_values():
    """RMSprop's own ``step()`` is traced per parameter: its updates read the stacks' layers
    one by one and the program stacks its results; the training is the same."""
    def rmsprop(params):
        return torch.optim.RMSprop(params, lr=1e-3, momentum=0.9)

    stacked = _train(rmsprop)
    with _per_tensor():
        per_tensor = _train(rmsprop)
    _assert_same_training(stacked, per_tensor)


def _stack_count(monkeypatch) -> list:
    calls = []
    stack = stacked_layers.stack_slots

    def counted(*args):
        calls.append(1)
        return stack(*args)

    monkeypatch.setattr(stacked_layers, "stack_slots", counted)
    return calls


def test_layers_read_and_written_between_steps(monkeypatch):
    """Reading a layer's tensors between steps gives that layer and keeps the stacks; a
    write (a parameter, a moment) is what the next step starts from."""
    seen = []

    def between(i, model, opt):
        weight = model.layers[1].feed_forward.w2.weight
        seen.append(weight.detach().cpu().clone())
        if i == 1:
            with torch.no_grad():
                model.layers[2].attention.wo.weight.mul_(0.5)
            opt.state[model.layers[0].attention.wq.weight]["exp_avg"].zero_()

    calls = _stack_count(monkeypatch)
    stacked = _train("adamw", between=between)
    stacked_seen, seen[:] = list(seen), []
    # Stacked once at the first call, again after the first compile (which registers modules
    # and so collects the step's inputs again) and after the writes; not after the reads.
    assert len(calls) == 2 * 3, len(calls)
    with _per_tensor():
        per_tensor = _train("adamw", between=between)
    _assert_same_training(stacked, per_tensor)
    assert all(torch.equal(a, b) for a, b in zip(stacked_seen, seen))


def test_reads_alone_keep_the_stacks(monkeypatch):
    calls = _stack_count(monkeypatch)
    _train("adamw", between=lambda i, model, opt: [
        p.detach().cpu() for p in model.parameters()] + [
        t.cpu() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)])
    assert len(calls) == 2 * 2, len(calls)  # the first call and after the first compile


def test_a_scanned_run_resumes_from_its_checkpoint(tmp_path):
    """``tpu-train`` with scanned layers: a run stopped at step 2 and resumed from its
    checkpoint (written from the layers' deferred slices, read back into per-layer tensors
    and stacked again) trains steps 3 and 4 as the uninterrupted run does."""
    import subprocess
    import sys

    from tests.platforms import cpu_child_env
    from tests.trainer.cli_helpers import read_metrics

    # A process of one device: the stacked step (an SPMD step keeps per-tensor arguments).
    env = cpu_child_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                        XLA_FLAGS="--xla_force_host_platform_device_count=1")

    common = ["recipe=llama_pretrain", "model=debug_tiny", "data.batch_size=4",
              "data.seq_len=32", "trainer.val_every_n_steps=0", "logging.progress_bar=false",
              "logging.every_n_steps=1", "checkpoint.export_hf=false",
              "scheduler.name=constant", "scheduler.warmup_steps=0", "scheduler.extend=true",
              "trainer.mode=compiled", "trainer.device=tpu", "trainer.scan_layers=true",
              "checkpoint.every_n_steps=2"]
    losses = {}
    for name, runs in (("whole", [4]), ("resumed", [2, 4])):
        run_dir = tmp_path / name
        for steps in runs:
            done = subprocess.run([sys.executable, "-m", "tpu_train.cli", *common,
                                   f"trainer.max_steps={steps}", f"run.dir={run_dir}"],
                                  env=env, capture_output=True, text=True, timeout=300)
            out = done.stdout
            assert done.returncode == 0, done.stderr[-3000:]
            assert "(1 device, 1 process)" in out, out
            assert "layers scanned" in out, out
        metrics = read_metrics(run_dir)
        losses[name] = [metrics[step]["train/loss"] for step in range(1, 5)]
    assert "(resumed from step_00000002)" in out, out
    assert losses["resumed"] == pytest.approx(losses["whole"], rel=RTOL)
    assert losses["whole"][3] != losses["whole"][2]  # it trained
