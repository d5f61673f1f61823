"""The compile cache: what recompiles, what does not, and what the log says about it."""

import logging

import pytest
import torch

from tests.tolerances import rtol_for
from tpu_train.compile import compile_train_step

from .helpers import DEVICE, mlp, mlp_loss

LOGGER = "tpu_train.compile"


def _batch(rows=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, 12, generator=g).to(dtype).to(DEVICE),
            "y": torch.randn(rows, 5, generator=g).to(DEVICE)}


def _cast_loss(model, batch):
    return mlp_loss(model, {"x": batch["x"].float(), "y": batch["y"]})


def test_first_call_and_shape_change_are_logged_with_the_input_name(caplog):
    model = mlp().to(DEVICE)
    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_loss)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        step(_batch(8))
        step(_batch(8, seed=1))  # same shapes: cached
        step(_batch(16))
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 2, messages
    assert "compilation #1 (first call)" in messages[0]
    assert "batch['x'] changed shape from (8, 12) to (16, 12)" in messages[1]
    assert "batch['y'] changed shape from (8, 5) to (16, 5)" in messages[1]
    records = step.compilations
    for message, record in zip(messages, records):
        # A session's persistent cache (a TPU keeps every program) may hold this program.
        xla = "loaded from the compilation cache" if record.from_cache else "XLA compile"
        assert "trace" in message and xla in message, message
    assert [r.cause for r in records][0] == "first call"
    assert all(r.trace_s > 0 and r.compile_s > 0 for r in records)
    # Going back to a shape compiled before hits the cache.
    with caplog.at_level(logging.INFO, logger=LOGGER):
        step(_batch(8, seed=2))
    assert len(step.compilations) == 2


def test_dtype_and_setting_changes_are_named(caplog):
    model = mlp().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    step = compile_train_step(model, opt, _cast_loss)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        step(_batch(8))
        step(_batch(8, dtype=torch.bfloat16))
        opt.param_groups[0]["weight_decay"] = 0.0
        step(_batch(8, dtype=torch.bfloat16))
        model.eval()
        step(_batch(8, dtype=torch.bfloat16))
    causes = [r.cause for r in step.compilations]
    assert causes[1] == "batch['x'] changed dtype from torch.float32 to torch.bfloat16"
    assert causes[2] == ("setting optimizer.param_groups[0]['weight_decay'] changed from 0.1 "
                         "to 0.0")
    assert causes[3] == "setting model.training changed from True to False"


def test_scheduler_lr_changes_do_not_recompile():
    model = mlp().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    step = compile_train_step(model, opt, mlp_loss, scheduler=sched)
    lrs = [float(step(_batch(8, seed=i))["lr"].cpu()) for i in range(5)]
    # The device's lr is the scheduler's Python float rounded once to float32.
    assert lrs == pytest.approx([1e-2 / (1 + i) for i in range(5)], rel=rtol_for(torch.float32))
    assert len(step.compilations) == 1
    # The group's lr stays a Python float: a couple of float64 roundings.
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 6, rel=rtol_for(torch.float64))


def test_warning_after_too_many_compilations(caplog):
    model = mlp().to(DEVICE)
    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_loss,
                              warn_after=2)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for rows in (2, 3, 4):
            step(_batch(rows))
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "compiled 3 times (more than 2)" in warnings[0].getMessage()
    assert "batch['x'] changed shape from (3, 12) to (4, 12)" in warnings[0].getMessage()


def test_optimized_program_has_no_64_bit_types():
    """x64 stays off: int64 token ids are stored as int32, nothing in the step is 64-bit."""
    from .helpers import lm_batches, lm_loss, tiny_llama

    model = tiny_llama().to(DEVICE)
    step = compile_train_step(model, torch.optim.AdamW(model.parameters()), lm_loss,
                              max_grad_norm=1.0)
    step({k: v.to(DEVICE) for k, v in lm_batches(1)[0].items()})
    (program,) = step.cache.entries.values()
    hlo = program.executable.as_text()
    assert "f32[" in hlo and "s32[" in hlo
    assert "f64" not in hlo and "s64" not in hlo and "u64" not in hlo


def test_describe_changes_names_added_removed_and_moved_inputs():
    from tpu_train.compile import Signature, describe_changes
    from tpu_train.compile.cache import InputSpec

    old = Signature((InputSpec("batch['a']", (2,), torch.float32, "tpu:0"),
                     InputSpec("batch['b']", (3,), torch.int64, "tpu:0")), (("donate", True),))
    new = Signature((InputSpec("batch['a']", (2,), torch.float32, "tpu:1"),
                     InputSpec("batch['c']", (4,), torch.int64, "tpu:0")), ())
    assert describe_changes(old, new) == [
        "batch['a'] moved from tpu:0 to tpu:1",
        "batch['c'] is new (shape (4,) dtype torch.int64 on tpu:0)",
        "batch['b'] is gone (was shape (3,) dtype torch.int64 on tpu:0)",
        "setting donate is gone (was True)",
    ]
    # A tpu batch leaf given as its whole flat storage, then as a view of a larger one.
    flat = Signature((InputSpec("batch['t']", (2, 3), torch.int64, "tpu:0", (6,)),), ())
    view = Signature((InputSpec("batch['t']", (2, 3), torch.int64, "tpu:0"),), ())
    assert describe_changes(flat, view) == ["batch['t'] is stored as (2, 3), was (6,)"]
    assert flat.inputs[0].describe() == "shape (2, 3) dtype torch.int64 (stored as (6,)) on tpu:0"
