"""``optim.name`` picks the ``torch.optim`` class from the command line, and the compiled step
(SPMD over the session's devices: the CPU client's 8 virtual ones, or one chip) trains with it
like the eager CPU step does."""

from __future__ import annotations

import pytest
import torch

from tests.tolerances import CROSS_ENTROPY_FUNCTIONS, llama_functions, loss_rtol
from tests.trainer.cli_helpers import TINY, TINY_COMPILED, one_thread, read_metrics, run_in_process
from tests.trainer.loss_bounds import FFN_HIDDEN, LAYERS
from tpu_train.device import runtime

__all__ = ["one_thread"]  # a fixture, used by name

RMSPROP = ["recipe=llama_pretrain", "optim.name=rmsprop", "optim.lr=1e-3", "optim.momentum=0.9",
           "trainer.max_steps=3"]


@pytest.mark.usefixtures("one_thread")
def test_rmsprop_by_name_compiled_matches_eager_cpu(tmp_path):
    losses, outputs = {}, {}
    for mode, overrides in (("compiled", TINY_COMPILED), ("eager", [*TINY, "data.batch_size=8"])):
        run_dir = tmp_path / mode
        code, outputs[mode], err = run_in_process(*RMSPROP, *overrides, f"run.dir={run_dir}")
        assert code == 0, err
        assert f"step: {mode}" in outputs[mode]
        losses[mode] = [r["train/loss"] for _, r in sorted(read_metrics(run_dir).items())]
    # RMSprop with momentum keeps two state tensors per parameter (square_avg, momentum_buffer).
    # Over several devices (the CPU client's 8) placing the compiled step on its mesh created
    # them before its first update, 3x the parameters; on one device (a v5e-1) nothing is
    # placed, and the first step creates them as the eager one does.
    assert "13.01 MiB of parameters on the busiest device (the optimizer state is allocated at " \
        "the first step)" in outputs["eager"]
    if runtime.device_count() > 1:
        assert "39.03 MiB of parameters + optimizer state" in outputs["compiled"]
    else:
        assert "13.01 MiB of parameters on the busiest device (the optimizer state is " \
            "allocated at the first step)" in outputs["compiled"]
    assert len(losses["compiled"]) == 3
    # 3 steps of debug_tiny (untrained: a loss ~log(vocab), relative), the compiled program on
    # the test platform vs CPU eager: float32 rounding and the platform's measured functions.
    rtol = loss_rtol(torch.float32, 3, FFN_HIDDEN, depth=LAYERS,
                     functions=llama_functions(LAYERS) + CROSS_ENTROPY_FUNCTIONS)
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=rtol)
    assert losses["compiled"][-1] < losses["compiled"][0]


def test_unknown_optimizer_name_lists_valid_names(tmp_path):
    code, _, err = run_in_process("recipe=llama_pretrain", *TINY, "optim.name=lbfgs",
                                  f"run.dir={tmp_path}")
    assert code != 0
    assert ("optim.name='lbfgs' is not supported; valid names: adamw, adam, sgd, rmsprop, "
            "adagrad, adadelta, nadam, radam, adamax, asgd") in err
