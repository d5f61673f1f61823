"""``optim.name`` picks the ``torch.optim`` class from the command line, and the compiled step
(SPMD over the session's 8 virtual devices) trains with it like the eager CPU step does."""

from __future__ import annotations

import pytest

from tests.trainer.cli_helpers import TINY, TINY_COMPILED, one_thread, read_metrics, run_in_process

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
    # RMSprop with momentum keeps two state tensors per parameter (square_avg, momentum_buffer):
    # the compiled step created them on the device before its first update, 3x the parameters.
    assert "13.01 MiB of parameters on" in outputs["eager"]
    assert "39.03 MiB of parameters + optimizer state" in outputs["compiled"]
    assert len(losses["compiled"]) == 3
    # 3 steps of a 2-layer debug Llama, SPMD data-parallel program vs CPU eager.
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)
    assert losses["compiled"][-1] < losses["compiled"][0]


def test_unknown_optimizer_name_lists_valid_names(tmp_path):
    code, _, err = run_in_process("recipe=llama_pretrain", *TINY, "optim.name=lbfgs",
                                  f"run.dir={tmp_path}")
    assert code != 0
    assert ("optim.name='lbfgs' is not supported; valid names: adamw, adam, sgd, rmsprop, "
            "adagrad, adadelta, nadam, radam, adamax, asgd") in err
