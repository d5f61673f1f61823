"""``trainer.mode=fused``: the eager step in fused eager mode, through the command line."""

from __future__ import annotations

import re

import pytest
import torch

from tests.trainer.cli_helpers import TINY, read_metrics, run_in_process
from tests.trainer.loss_bounds import assert_base_model_losses_close, base_model_grad_norm_rtol
from tpu_train.device import lazy

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 4
# TINY's shapes on the tpu device (TINY itself runs plain PyTorch on the CPU).
ON_TPU = [*TINY[:-2], "trainer.device=tpu", f"trainer.max_steps={STEPS}"]


def _logged(out: str) -> list[tuple[str, str]]:
    return re.findall(r"step \d+/\d+ \| loss (\S+) \| lr \S+ \| grad_norm (\S+)", out)


def test_fused_mode_trains_like_eager_and_compiles_its_regions_once(tmp_path):
    code, eager_out, err = run_in_process(*ON_TPU, "trainer.mode=eager",
                                          f"run.dir={tmp_path / 'eager'}")
    assert code == 0, err
    before = lazy.stats()
    code, fused_out, err = run_in_process(*ON_TPU, "trainer.mode=fused",
                                          f"run.dir={tmp_path / 'fused'}")
    assert code == 0, err
    after = lazy.stats()
    assert "step: fused" in fused_out
    assert len(_logged(fused_out)) == len(_logged(eager_out)) == STEPS
    # The recorded values (full precision) within the derived bounds: the same computation
    # fused differently (on a chip, XLA's exp inside a fusion is not the one of a single op), its
    # dots at the same precision on both sides.
    eager, fused = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "fused")
    assert sorted(eager) == sorted(fused) == list(range(1, STEPS + 1))
    assert_base_model_losses_close([fused[s]["train/loss"] for s in sorted(fused)],
                                   [eager[s]["train/loss"] for s in sorted(eager)], rows=2,
                                   matmul_dtype=torch.float32)
    for s in sorted(eager):
        assert fused[s]["train/grad_norm"] == pytest.approx(
            eager[s]["train/grad_norm"], rel=base_model_grad_norm_rtol(s)), s
    # Each step runs as regions (forward + backward up to the finiteness check, then the
    # update); the first two steps compile them (the optimizer state is created at the
    # first), later steps reuse the programs.
    assert after["regions_run"] - before["regions_run"] >= 2 * STEPS
    assert after["programs_compiled"] - before["programs_compiled"] <= 6
    assert lazy.mode() == "strict"


def test_a_bad_region_size_is_one_line_before_the_run_starts(tmp_path, monkeypatch):
    monkeypatch.setenv(lazy.MAX_OPS_ENV, "many")
    code, out, err = run_in_process(*ON_TPU, "trainer.mode=fused", f"run.dir={tmp_path / 'run'}")
    assert code == 2, (out, err)
    assert err.strip().count("\n") == 0 and "TPU_TRAIN_FUSED_MAX_OPS='many'" in err, err
    assert not (tmp_path / "run").exists()
