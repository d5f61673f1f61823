"""JAX's persistent compilation cache (``TPU_TRAIN_CACHE_DIR``): where it goes, ``off``, a bad
value, and a train step compiled by one process and loaded by the next."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tpu_train.compile.cache import CompileRecord, TimedStages
from tpu_train.device import compilation_cache as cc
from tpu_train.trainer.summary import describe_compilation

# The brief's tiny compiled step: one device, one step, no validation, no export.
_STEP = ["recipe=llama_pretrain", "model=debug_tiny", "trainer.max_steps=1",
         "data.batch_size=8", "data.seq_len=32", "trainer.val_every_n_steps=0",
         "checkpoint.export_hf=false", "logging.progress_bar=false",
         "scheduler.warmup_steps=1", "trainer.device=tpu", "trainer.mode=compiled"]
_LINE = re.compile(r"^(compiled|loaded) the train step.*$", re.MULTILINE)


def _env(tmp_path: Path, cache) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               TPU_TRAIN_PLATFORM="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    env[cc.CACHE_DIR_ENV] = str(cache)
    return env


def _train(tmp_path: Path, name: str, cache) -> str:
    """The compile line printed by a 1-step ``tpu-train`` run in a child process."""
    proc = subprocess.run(
        [sys.executable, "-m", "tpu_train.cli", *_STEP, f"run.dir={tmp_path / name}"],
        env=_env(tmp_path, cache), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    found = _LINE.search(proc.stdout)
    assert found, proc.stdout[-2000:]
    return found.group(0)


def _seconds(line: str) -> float:
    return float(re.search(r" in ([0-9.]+) s", line).group(1))


@pytest.mark.multiprocess
def test_second_process_loads_the_step_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = _train(tmp_path, "first", cache)
    second = _train(tmp_path, "second", cache)
    assert first.startswith("compiled the train step"), first
    assert second.startswith("loaded the train step from the compilation cache"), second
    assert any(p.name.endswith("-cache") for p in cache.iterdir())
    # Figures for the record only: speed is not asserted on a shared machine.
    print(f"\nfirst: {first}\nsecond: {second}\n"
          f"({_seconds(first):.1f} s -> {_seconds(second):.1f} s)")


@pytest.mark.multiprocess
def test_off_writes_nothing(tmp_path):
    line = _train(tmp_path, "run", "off")
    assert line.startswith("compiled the train step"), line
    for root in (tmp_path / "home", tmp_path / "xdg"):
        assert not root.exists() or not any(root.rglob("*")), sorted(root.rglob("*"))


def test_a_bad_directory_is_a_clear_error_at_first_use(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    code = "from tpu_train.device import runtime; runtime.platform()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(tmp_path, not_a_dir / "xla"), timeout=120)
    assert proc.returncode != 0
    assert "CompilationCacheError" in proc.stderr
    assert f"{cc.CACHE_DIR_ENV}: cannot create the compilation cache directory" in proc.stderr


def _one_op_in_a_child(tmp_path: Path, tpu_policy: bool) -> list[str]:
    """The cache's compile-time threshold after a first device op in a fresh process on the
    cpu platform, and how many entries that op's program wrote; ``tpu_policy`` makes the
    process keep programs as on a TPU."""
    code = ("import jax, torch, tpu_train\n"
            "from tpu_train.device import compilation_cache as cc\n"
            + ("cc.min_compile_time_s = lambda platform: cc.TPU_MIN_COMPILE_TIME_S\n"
               if tpu_policy else "")
            + "(torch.arange(6.0, device='tpu') * 3).cpu()\n"
            "print(jax.config.jax_persistent_cache_min_compile_time_secs)\n"
            "print(sum(1 for p in cc.directory().iterdir() if p.name.endswith('-cache')))\n")
    cache = tmp_path / ("tpu" if tpu_policy else "cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(tmp_path, cache), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


def test_a_tpu_keeps_every_program_the_cpu_client_the_slow_ones(tmp_path):
    """A one-op program compiles in milliseconds on the CPU client and is not written; on a
    TPU it takes ~43 ms and reads back in ~2 ms, so every program is written there."""
    assert cc.min_compile_time_s("tpu") == 0.0 and cc.min_compile_time_s("cpu") == 1.0
    threshold, entries = _one_op_in_a_child(tmp_path, tpu_policy=False)
    assert float(threshold) == 1.0 and int(entries) == 0
    threshold, entries = _one_op_in_a_child(tmp_path, tpu_policy=True)
    assert float(threshold) == 0.0 and int(entries) >= 1


def test_requested_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(cc.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.requested_dir() == tmp_path / "xdg" / "tpu_train" / "xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cc.requested_dir() == tmp_path / "home" / ".cache" / "tpu_train" / "xla"
    for off in ("off", "OFF", " false ", "0", "none"):
        monkeypatch.setenv(cc.CACHE_DIR_ENV, off)
        assert cc.requested_dir() is None
    monkeypatch.setenv(cc.CACHE_DIR_ENV, "~/xla")
    assert cc.requested_dir() == tmp_path / "home" / "xla"
    monkeypatch.setenv(cc.CACHE_DIR_ENV, "gs://bucket/xla")
    with pytest.raises(cc.CompilationCacheError, match="only a local directory"):
        cc.requested_dir()


def test_bad_size_bound(monkeypatch):
    monkeypatch.setenv(cc.MAX_SIZE_ENV, "lots")
    with pytest.raises(cc.CompilationCacheError, match=cc.MAX_SIZE_ENV):
        cc._max_size_bytes()
    monkeypatch.setenv(cc.MAX_SIZE_ENV, "0.5")
    assert cc._max_size_bytes() == 2**29


def test_timed_stages_count_cache_hits():
    stages = TimedStages()
    stages.time("lower", lambda: None)
    assert not stages.from_cache  # nothing compiled
    stages.time("compile", cc._on_event, "/jax/compilation_cache/cache_hits")
    assert stages.from_cache
    stages.time("compile", lambda: None)  # a second program, compiled
    assert not stages.from_cache


def test_describe_compilation_says_compiled_or_loaded():
    compiled = CompileRecord("first call", 1.2, 0.6, 2.3, 100)
    loaded = CompileRecord("first call", 1.2, 0.6, 0.3, 100, from_cache=True)
    assert describe_compilation(compiled) == (
        "compiled the train step in 4.1 s (trace 1.2, lower 0.6, XLA 2.3): first call")
    assert describe_compilation(loaded) == (
        "loaded the train step from the compilation cache in 2.1 s (trace 1.2, lower 0.6, "
        "XLA load 0.3): first call")
    scanned = CompileRecord("first call", 1.2, 0.6, 2.3, 100, scanned_layers=32)
    assert describe_compilation(scanned).endswith("XLA 2.3): first call; 32 layers scanned")
