"""One-op programs (eager op executables, in-place ops, fills, storage reads and writes) and
eager mode's recorded regions (strict and fused) are compiled with
``runtime.op_program_options()``: XLA's least optimization effort, unless the user chose an
effort for every program through JAX."""

from __future__ import annotations

import jax
import pytest
import torch

from tpu_train.device import lazy, runtime

TPU = torch.device("tpu", 0)
# An option XLA does not know: a program compiled with it fails, naming it, which shows the
# options reached that program's compile.
UNKNOWN = "xla_tpu_train_test_unknown_option"


@pytest.fixture
def jax_effort():
    """Sets JAX's effort for the test (JAX reads the environment's once, at import: the TPU
    lane's runs with one set) and restores it after."""
    previous = jax.config.jax_exec_time_optimization_effort
    yield lambda effort: jax.config.update("jax_exec_time_optimization_effort", effort)
    jax.config.update("jax_exec_time_optimization_effort", previous)


def test_least_effort_unless_the_user_set_one(monkeypatch, jax_effort):
    monkeypatch.delenv(runtime.EFFORT_ENV, raising=False)
    jax_effort(0.0)
    assert runtime.op_program_options() == {"exec_time_optimization_effort": -1.0}
    monkeypatch.setenv(runtime.EFFORT_ENV, "0.5")
    assert runtime.op_program_options() is None
    monkeypatch.delenv(runtime.EFFORT_ENV)
    jax_effort(-0.5)
    assert runtime.op_program_options() is None


# Shapes no other test uses: each program below is made (and cached) with the unknown option.
@pytest.mark.parametrize("program", ["op", "in_place_op", "fill", "strided_read",
                                     "strided_write_from_host"])
def test_each_kind_of_one_op_program_compiles_with_them(monkeypatch, program):
    source = torch.arange(37 * 41, dtype=torch.float32).reshape(37, 41).to(TPU)
    monkeypatch.setattr(runtime, "op_program_options", lambda: {UNKNOWN: True})
    with pytest.raises(Exception, match=UNKNOWN):
        if program == "op":
            (source * 3).cpu()
        elif program == "in_place_op":
            source.mul_(3).cpu()
        elif program == "fill":
            for _ in range(2):  # on a TPU a size's first fill is a transfer from the host
                torch.full((43, 47), 2.0, device=TPU).cpu()
        elif program == "strided_read":
            source[1:30:3, 2:40:5].cpu()
        else:
            source[2:31:3, 3:41:5].copy_(torch.ones(10, 8))
            source.cpu()


def test_a_strict_backward_region_compiles_with_them(monkeypatch):
    """Strict mode records a backward pass and runs it as one program (rounded per op): it
    stands for the one-op programs it replaces and is compiled with their options."""
    weight = torch.full((53, 59), 0.5).to(TPU).requires_grad_()
    for _ in range(2):  # every one-op program the next backward needs (2nd: donating ones)
        (weight * weight).sum().backward()
    loss = (weight * weight * weight).sum()  # a longer backward: a region not compiled yet
    monkeypatch.setattr(runtime, "op_program_options", lambda: {UNKNOWN: True})
    with pytest.raises(Exception, match=UNKNOWN):
        loss.backward()
        weight.grad.cpu()


def test_a_fused_region_compiles_with_them(monkeypatch):
    """A fused-mode region is compiled in the user's first steps, like the one-op programs it
    replaces, and gets their options (the least effort: its compile is what a fused step's
    first use waits for, and the step is host-bound after)."""
    import tpu_train

    source = torch.full((61, 67), 0.25).to(TPU)
    monkeypatch.setattr(runtime, "op_program_options", lambda: {UNKNOWN: True})
    with pytest.raises(Exception, match=UNKNOWN):
        with tpu_train.eager_mode("fused"):  # leaving the mode runs the region
            result = (source * 5 + 1).exp().sum(0)
        result.cpu()
    assert lazy.mode() == lazy.STRICT  # left, though the region failed
    assert lazy.active is bool(lazy.records_everything)
