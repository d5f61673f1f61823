"""One-op programs (eager op executables, in-place ops, fills, storage reads and writes) are
compiled with ``runtime.op_program_options()``: XLA's least optimization effort, unless the
user chose an effort for every program through JAX."""

from __future__ import annotations

import jax
import pytest
import torch

from tpu_train.device import runtime

TPU = torch.device("tpu", 0)
# An option XLA does not know: a program compiled with it fails, naming it, which shows the
# options reached that program's compile.
UNKNOWN = "xla_tpu_train_test_unknown_option"


def test_least_effort_unless_the_user_set_one(monkeypatch):
    monkeypatch.delenv(runtime.EFFORT_ENV, raising=False)
    assert runtime.op_program_options() == {"exec_time_optimization_effort": -1.0}
    monkeypatch.setenv(runtime.EFFORT_ENV, "0.5")
    assert runtime.op_program_options() is None
    monkeypatch.delenv(runtime.EFFORT_ENV)
    previous = jax.config.jax_exec_time_optimization_effort
    jax.config.update("jax_exec_time_optimization_effort", -0.5)
    try:
        assert runtime.op_program_options() is None
    finally:
        jax.config.update("jax_exec_time_optimization_effort", previous)


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
            torch.full((43, 47), 2.0, device=TPU).cpu()
        elif program == "strided_read":
            source[1:30:3, 2:40:5].cpu()
        else:
            source[2:31:3, 3:41:5].copy_(torch.ones(10, 8))
            source.cpu()
