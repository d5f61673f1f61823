"""A train step compiled ahead of time: ``compile.save_executable=PATH`` writes it through the
job's own command (in a child process, as on another host), ``compile.executable=PATH`` runs
the job without XLA compiling its step, with the same losses; a job whose step differs stops
with a one-line error naming the difference, before anything is written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.platforms import cpu_child_env
from tests.trainer.cli_helpers import ROOT, TINY_COMPILED, run_in_process, start_subprocess
from tpu_train.compile.targets import libtpu_available
from tpu_train.device import runtime

JOB = [*TINY_COMPILED, "trainer.max_steps=3", "data.prefetch=0"]


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def _losses(run_dir) -> list[float]:
    return [r["train/loss"] for r in _records(run_dir) if "train/loss" in r]


def _startup(run_dir) -> dict:
    [row] = [r for r in _records(run_dir) if any(k.startswith("startup/") for k in r)]
    return {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("startup/")}


def _save(*overrides: str, cwd) -> tuple[int, str, str]:
    child = start_subprocess(*JOB, *overrides, f"run.dir={cwd / 'never_written'}", cwd=cwd)
    out, err = child.communicate(timeout=600)
    return child.returncode, out, err


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The job's step, written by its own command in another process."""
    work = tmp_path_factory.mktemp("saved_step")
    path = work / "step.xla"
    code, out, err = _save(f"compile.save_executable={path}", cwd=work)
    assert code == 0, err
    assert f"wrote {path} " in out and f"compile.executable={path}" in out, out
    assert not (work / "never_written").exists()  # compiling only writes no run
    manifest = json.loads((work / "step.xla.json").read_text())
    assert manifest["environment"]["platform"] == "cpu"
    assert manifest["environment"]["mesh"] == {"data": 8, "fsdp": 1, "expert": 1, "context": 1,
                                                "tensor": 1}
    return path


def test_a_loaded_step_compiles_nothing_and_trains_bitwise_the_same(saved, tmp_path):
    code, out, err = run_in_process(*JOB, f"compile.executable={saved}",
                                    f"run.dir={tmp_path / 'loaded'}")
    assert code == 0, err
    [row] = [line for line in out.splitlines() if "train step start-up:" in line]
    assert "XLA compile 0.0 s, cache read 0.0 s, executable load " in row, row
    startup = _startup(tmp_path / "loaded")
    assert startup["xla_compile_s"] == 0.0 and startup["cache_read_s"] == 0.0
    assert startup["executable_load_s"] > 0 and startup["programs"] == 1.0
    assert startup["trace_s"] > 0 and startup["lower_s"] > 0  # traced and lowered as always
    log = (tmp_path / "loaded" / "train.log").read_text()
    assert f"loaded the train step from {saved} in " in log

    code, out, err = run_in_process(*JOB, f"run.dir={tmp_path / 'compiled'}")
    assert code == 0, err
    compiled = _startup(tmp_path / "compiled")  # a test session on a chip keeps a cache
    assert compiled["xla_compile_s"] + compiled["cache_read_s"] > 0
    assert compiled["executable_load_s"] == 0.0
    assert len(_losses(tmp_path / "loaded")) == 3
    assert _losses(tmp_path / "loaded") == _losses(tmp_path / "compiled")  # bitwise


def _one_line_error(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("tpu-train: error: compile.executable: "), err
    return lines[0]


def test_another_batch_size_is_a_one_line_error(saved, tmp_path):
    code, _, err = run_in_process(*JOB, "data.batch_size=16", f"compile.executable={saved}",
                                  f"run.dir={tmp_path / 'run'}")
    line = _one_line_error(code, err)
    assert "batch['tokens'] is shape (8, 32) dtype torch.int64 there, shape (16, 32) " in line
    assert not (tmp_path / "run").exists()


def test_another_model_is_a_one_line_error(saved, tmp_path):
    # LoRA adapters: other trainable parameters, another program.
    code, _, err = run_in_process(*JOB, "recipe=llama_lora", f"compile.executable={saved}",
                                  f"run.dir={tmp_path / 'run'}")
    line = _one_line_error(code, err)
    assert "compiled for another step without param " in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["environment"].update(jax="0.0.1"), "was compiled for jax 0.0.1, this job has "),
    (lambda m: m.update(fingerprint="0" * 64), "was compiled from another lowered program"),
    (lambda m: m.update(sha256="0" * 64), "is damaged"),
], ids=["jax_version", "lowered_module", "damaged"])
def test_a_manifest_that_differs_is_a_one_line_error(saved, tmp_path, edit, message):
    copy = tmp_path / "step.xla"
    shutil.copy(saved, copy)
    manifest = json.loads(saved.with_name("step.xla.json").read_text())
    edit(manifest)
    (tmp_path / "step.xla.json").write_text(json.dumps(manifest))
    code, _, err = run_in_process(*JOB, f"compile.executable={copy}",
                                  f"run.dir={tmp_path / 'run'}")
    line = _one_line_error(code, err)
    assert message in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides,message", [
    (["compile.executable=x.xla", "compile.save_executable=y.xla"], "are both set"),
    (["compile.target=v5e:1x1"], "set compile.save_executable=PATH too"),
    (["compile.save_executable=y.xla", "compile.target=v9x"], "compile.target: unknown TPU"),
    (["compile.executable=missing.xla"], "compile.executable=missing.xla: no such file"),
    (["compile.save_executable=y.xla", "trainer.mode=eager", "trainer.device=cpu"],
     "trainer.mode=eager compiles no step"),
])
def test_options_that_cannot_be_followed_are_one_line_errors(overrides, message, tmp_path):
    code, _, err = run_in_process(*JOB, *overrides, f"run.dir={tmp_path / 'run'}")
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not libtpu_available(), reason="XLA's TPU compiler (libtpu) is not installed")
def test_a_step_compiled_for_a_v5e_without_the_chip_is_written(tmp_path):
    """XLA's TPU compiler for a v5e:1x1 that need not be here: the executable serializes; a
    host of another platform refuses it in one line, a v5e runs the job on it."""
    path = tmp_path / "step_v5e.xla"
    # One device: the job's step is the single-device program a v5e:1x1 runs.
    env = cpu_child_env(ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=1",
                        OMP_NUM_THREADS="1")
    child = subprocess.run(
        [sys.executable, "-m", "tpu_train.cli", *JOB, "data.batch_size=2",
         f"compile.save_executable={path}", "compile.target=v5e:1x1",
         f"run.dir={tmp_path / 'never_written'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stderr
    assert "compiled the train step for v5e:1x1 " in child.stdout, child.stdout
    environment = json.loads((tmp_path / "step_v5e.xla.json").read_text())["environment"]
    assert (environment["platform"], environment["device kind"]) == ("tpu", "TPU v5 lite")
    assert environment["libtpu"] and environment["devices"] == 1
    assert path.stat().st_size > 1_000_000
    # Here the session's 8 devices take 8 rows (the platform differs first); a v5e takes 2.
    on_tpu = runtime.platform() == "tpu"
    code, out, err = run_in_process(*JOB, f"data.batch_size={2 if on_tpu else 8}",
                                    f"compile.executable={path}", f"run.dir={tmp_path / 'run'}")
    if on_tpu:  # a v5e runs it
        assert code == 0, err
        assert _startup(tmp_path / "run")["xla_compile_s"] == 0.0, out
    else:
        line = _one_line_error(code, err)
        assert "was compiled for platform tpu, this job has cpu" in line, line


def test_an_unknown_tpu_train_version_is_not_compared_a_different_one_is():
    """A checkout run from PYTHONPATH (a TPU VM without the package installed) knows no
    installed version of tpu_train: that alone does not refuse the executable."""
    from tpu_train.compile import saved_executable

    manifest = {"environment": {"jax": "1", "tpu_train": "0.1.0", "tpu_train commit": "abc"}}
    saved_executable.check_environment("s.xla", manifest,
                                       {"jax": "1", "tpu_train": None, "tpu_train commit": None})
    with pytest.raises(saved_executable.ExecutableMismatchError, match="tpu_train 0.1.0"):
        saved_executable.check_environment("s.xla", manifest, {"jax": "1", "tpu_train": "0.2.0"})
