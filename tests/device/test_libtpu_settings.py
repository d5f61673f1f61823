"""libtpu's settings the project starts a TPU backend with (tpu_train.device.libtpu_settings):
added to ``LIBTPU_INIT_ARGS`` where the user did not name them, and accepted by libtpu itself
(an unknown flag makes libtpu refuse to start)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpu_train.device import libtpu_settings

ROOT = Path(__file__).resolve().parents[2]
FLAG = "fibers_default_domain_concurrency"


def test_defaults_are_added_after_the_users_own_flags():
    env = {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=true"}
    libtpu_settings.apply_defaults(env)
    assert env["LIBTPU_INIT_ARGS"].split() == [
        "--xla_tpu_enable_latency_hiding_scheduler=true", f"--{FLAG}=2"]
    empty: dict[str, str] = {}
    libtpu_settings.apply_defaults(empty)
    assert empty == {"LIBTPU_INIT_ARGS": f"--{FLAG}=2"}


@pytest.mark.parametrize("users", [f"--{FLAG}=7", f"-{FLAG}=7", f"--other=1 --{FLAG}=7"])
def test_a_flag_the_user_set_is_left_as_they_set_it(users):
    env = {"LIBTPU_INIT_ARGS": users}
    libtpu_settings.apply_defaults(env)
    assert env["LIBTPU_INIT_ARGS"] == users
    libtpu_settings.apply_defaults(env)  # applying twice changes nothing either
    assert env["LIBTPU_INIT_ARGS"] == users


COMPILE_FOR_V5E = """
import os, torch, tpu_train
from tpu_train.compile import targets
devices = targets.resolve_target("v5e:1x1").devices
print(os.environ["LIBTPU_INIT_ARGS"], len(devices))
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install tpu_train[tpu])")
@pytest.mark.parametrize("users", [None, f"--{FLAG}=3"])
def test_libtpu_starts_with_the_settings(users):
    """A compile-only v5e topology loads libtpu with the flags as applied: libtpu knows them
    (it refuses unknown ones), and the user's own value is the one it gets."""
    env = dict(os.environ, TPU_TRAIN_PLATFORM="cpu")
    env.pop("LIBTPU_INIT_ARGS", None)
    if users is not None:
        env["LIBTPU_INIT_ARGS"] = users
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_V5E], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *flags, devices = proc.stdout.split()
    # On a TPU host JAX adds flags of its own; this one is there once, with the user's value.
    assert [f for f in flags if FLAG in f] == [users or f"--{FLAG}=2"] and devices == "1"
