"""Strict mode recording every op it can (``TPU_TRAIN_STRICT_RECORD=all``, lazy.records_everything;
the default on a TPU): the forward too runs as one region when a value is needed, each op rounded
as when run alone.

Oracles: debug mode (each op alone) for the rounding, PyTorch on CPU for a training run within
the tolerances tests/tolerances.py derives for the platform.
"""

import subprocess
import sys

import pytest
import torch

import tpu_train
from tpu_train.device import lazy
from tests.platforms import cpu_child_env
from tests.device.test_strict_multi_tensor import STEPS, _model, _train, assert_matches_cpu

TPU = torch.device("tpu", 0)


@pytest.fixture
def records_everything():
    """Strict mode with every op recorded for the test, on every platform."""
    assert lazy.mode() == lazy.STRICT
    with lazy.strict_recording(True):
        yield


def _bf16_chain():
    x = torch.linspace(-2, 2, 96, dtype=torch.bfloat16).to(TPU)
    # XLA may compute such a chain in float32 and round once: a region rounded per op may not.
    return ((x * 1.7).tanh() * 3 + x.sigmoid() * x).exp()


def test_a_forward_is_recorded_until_read_and_rounds_like_each_op_alone(records_everything):
    _bf16_chain().cpu()  # an op's first call runs alone
    before = lazy.stats()
    pending = _bf16_chain()
    recorded = lazy.stats()
    assert recorded["ops_recorded"] - before["ops_recorded"] >= 7
    assert recorded["regions_run"] == before["regions_run"]  # nothing ran yet
    result = pending.cpu()
    assert lazy.stats()["regions_run"] == before["regions_run"] + 1
    with tpu_train.eager_mode("debug"):
        alone = _bf16_chain().cpu()
    assert torch.equal(result, alone)


def test_training_matches_cpu(records_everything):
    cpu_losses, cpu_params = _train(_model(), torch.device("cpu"), steps=STEPS)
    counts = []
    losses, params = _train(_model(), TPU, steps=STEPS, counts=counts)
    # Steps 3-4 record every op (their forward too): reading each loss runs one region.
    assert counts[1]["regions_run"] - counts[0]["regions_run"] <= 2
    assert_matches_cpu((losses, params), (cpu_losses, cpu_params))


def test_a_shape_error_is_raised_at_the_op(records_everything):
    a, b = torch.ones(3, 4, device=TPU), torch.ones(5, 4, device=TPU)
    with pytest.raises(RuntimeError, match="broadcast"):
        a + b


def test_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv(lazy.STRICT_RECORD_ENV, "forward")
    with pytest.raises(lazy.EagerModeError, match="TPU_TRAIN_STRICT_RECORD='forward'"):
        lazy.strict_record_from_environment()
    for value, recording in (("all", True), (" Backward", False), ("", None)):
        monkeypatch.setenv(lazy.STRICT_RECORD_ENV, value)
        assert lazy.strict_record_from_environment() is recording


def _recording_in_a_child(setting: str | None, tpu_policy: bool = False) -> list[str]:
    """``lazy.records_everything`` and ``lazy.active`` in strict mode in a fresh process on the
    cpu platform, before and after its first device use, then the regions 7 ops ran before
    anything read them, with regions of at most 3 ops (``TPU_TRAIN_FUSED_MAX_OPS``: one ran at
    the 4th op, one at the 7th); ``tpu_policy`` makes that process judge its platform as a TPU
    is judged."""
    env = cpu_child_env()
    env.pop(lazy.STRICT_RECORD_ENV, None)
    env[lazy.MAX_OPS_ENV] = "3"
    if setting is not None:
        env[lazy.STRICT_RECORD_ENV] = setting
    code = ("import torch, tpu_train\n"
            "from tpu_train.device import lazy\n"
            + ("lazy.records_everything_on = lambda platform: True\n" if tpu_policy else "")
            + "print(lazy.records_everything, lazy.active)\n"
            "x = torch.ones(3, device='tpu') * 2\n"
            "print(lazy.records_everything, lazy.active, x.sum().item())\n"
            "before = lazy.stats()['regions_run']\n"
            "for _ in range(7):\n"
            "    x = x + 1\n"
            "print(lazy.stats()['regions_run'] - before, x.sum().item())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split("\n")[:3]


def test_unset_the_platform_decides_when_it_is_chosen():
    """A TPU records every op (a program call costs ~0.1 ms of host time there), the CPU
    client runs each op when called; the choice is made before the first device op, and the
    region size applies to strict mode's regions then."""
    assert lazy.records_everything_on("tpu") and not lazy.records_everything_on("cpu")
    assert _recording_in_a_child(None, tpu_policy=True) == ["None False", "True True 6.0",
                                                            "2 27.0"]
    # A setting wins over the platform: each op runs when called, no region.
    assert _recording_in_a_child("backward", tpu_policy=True) == ["False False",
                                                                  "False False 6.0", "0 27.0"]


def test_a_region_failing_as_a_block_starts_leaves_the_mode_as_it_was(records_everything,
                                                                       monkeypatch):
    """Entering fused mode runs what strict mode recorded; where that fails, the error is raised
    and the process is back in strict mode, not left in fused mode."""
    from tpu_train.device import runtime

    unknown = "xla_tpu_train_test_unknown_option"
    pending = torch.full((71, 73), 0.5).to(TPU) * 3  # recorded, not run
    monkeypatch.setattr(runtime, "op_program_options", lambda: {unknown: True})
    with pytest.raises(Exception, match=unknown):
        with tpu_train.eager_mode("fused"):
            pass
    assert lazy.mode() == lazy.STRICT
    del pending
