"""scripts/count_eager_compiles.py: its counters see JAX's compiles (the event names of the
installed JAX), tell identical programs apart from distinct ones, and refuse a bad --steps."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import count_eager_compiles as script  # noqa: E402


def test_counts_each_compile_and_identical_programs_once():
    import jax
    import jax.numpy as jnp

    x = jnp.arange(7.0)  # its own program, before counting
    x.block_until_ready()
    counter = script.Counter()
    jax.monitoring.register_event_duration_secs_listener(counter.on_duration)
    stop = script.watch_modules(counter)
    try:
        before = counter.snapshot()
        # Two separate jits of the same computation, and one different program: three compiles.
        jax.jit(lambda a: a * 3.0 + 1.0)(x).block_until_ready()
        jax.jit(lambda a: a * 3.0 + 1.0)(x).block_until_ready()
        jax.jit(lambda a: a - 2.0)(x).block_until_ready()
        delta = script._delta(before, counter.snapshot(), wall=1.0)
    finally:
        stop()
        jax.monitoring.unregister_event_duration_listener(counter.on_duration)
    assert delta["compiles"] == 3
    assert delta["xla_compile_s"] >= 0 and delta["lower_s"] >= 0
    assert len(counter.modules) == 2
    assert sorted(counter.modules.values()) == [1, 2]


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_bad_steps_is_one_line_error(steps):
    env = dict(os.environ, TPU_TRAIN_PLATFORM="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "count_eager_compiles.py"),
                           "--steps", steps], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert f"--steps must be >= 1, got {steps}" in proc.stderr
    assert proc.stdout == ""
