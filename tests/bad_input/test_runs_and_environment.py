"""Bad run directories, recipes without a model, multiruns and environments: one line, exit 2,
nothing written."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.bad_input.conftest import assert_one_line_error, run_against
from tests.platforms import cpu_child_env
from tests.trainer.cli_helpers import TINY, run_in_process, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")

RUN_DIRS = {
    "empty": ("", "run.dir is empty"),
    "a_file": ("BLOCKER", "is a file, not a directory"),
    "under_a_file": ("BLOCKER/run", "which is a file"),
    # Writable by its permission bits (to root), yet no directory can be made there.
    "on_a_pseudo_filesystem": ("/proc/tpu-train-run/run", "run.dir='/proc/tpu-train-run/run': "),
}


@pytest.mark.parametrize("where", sorted(RUN_DIRS))
def test_unusable_run_dir(where, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    run_dir, expected = RUN_DIRS[where]
    before = snapshot(tmp_path)
    code, out, err = run_in_process(*TINY, "trainer.max_steps=1",
                                    f"run.dir={run_dir.replace('BLOCKER', str(blocker))}")
    assert_one_line_error(code, out, err, expected)
    assert snapshot(tmp_path) == before


# recipe=eval / generate evaluate a model: with neither model.checkpoint nor a checkpoint in
# run.dir there is none (random weights would print plausible numbers about nothing).
NO_MODEL = {
    "eval_missing_run_dir": ("eval", "MISSING", "does not exist"),
    "eval_run_dir_without_checkpoint": ("eval", "EMPTY", "holds no checkpoint"),
    "generate_missing_run_dir": ("generate", "MISSING", "does not exist"),
    "generate_run_dir_without_checkpoint": ("generate", "EMPTY", "holds no checkpoint"),
}


@pytest.mark.parametrize("name", sorted(NO_MODEL))
def test_recipe_without_a_model(name, tmp_path):
    recipe, where, expected = NO_MODEL[name]
    (tmp_path / "empty").mkdir()
    run_dir = tmp_path / where.lower()
    before = snapshot(tmp_path)
    code, out, err = run_in_process(f"recipe={recipe}", "trainer.device=cpu", "trainer.mode=eager",
                                    f"run.dir={run_dir}")
    assert_one_line_error(code, out, err, f"recipe={recipe} needs a model")
    assert expected in err
    assert snapshot(tmp_path) == before


MULTIRUNS = {
    "bad_value_in_second_job": (["trainer.seed=1,x"], "trainer.seed"),
    "bad_key_in_sweep": (["trainer.maxsteps=1,2"], "section 'trainer' has keys"),
    "invalid_second_job": (["optim.lr=1e-3,-1"], "optim.lr must be > 0"),
}


@pytest.mark.parametrize("name", sorted(MULTIRUNS))
def test_bad_multirun_writes_nothing(name, existing_run):
    """Every job of a sweep is checked before the first starts: none runs, no multirun.yaml."""
    overrides, expected = MULTIRUNS[name]
    before = snapshot(existing_run)
    code, out, err = run_in_process("-m", *TINY, "trainer.max_steps=2", f"run.dir={existing_run}",
                                    *overrides)
    assert_one_line_error(code, out, err, expected)
    assert snapshot(existing_run) == before


# The launch variables torch.distributed reads, set by hand or half set: checked before any
# rendezvous is attempted (in-process: nothing has joined a group yet when they fail).
LAUNCH_ENVIRONMENTS = {
    "world_size_not_a_number": ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a number"),
    "world_size_zero": ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    "rank_missing": ({"WORLD_SIZE": "2"}, "RANK is not set"),
    "rank_out_of_range": ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK='5' must be an integer in [0, 1]"),
    "master_addr_missing": ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR is not set"),
    "master_port_not_a_port": ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": "http"}, "MASTER_PORT='http' must be an integer"),
    "collective_timeout_not_seconds": (
        {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
         "TPU_TRAIN_COLLECTIVE_TIMEOUT": "soon"}, "TPU_TRAIN_COLLECTIVE_TIMEOUT='soon'"),
}


@pytest.mark.parametrize("name", sorted(LAUNCH_ENVIRONMENTS))
def test_bad_launch_environment(name, existing_run, monkeypatch):
    variables, expected = LAUNCH_ENVIRONMENTS[name]
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "TPU_TRAIN_COLLECTIVE_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    before = snapshot(existing_run)
    code, out, err = run_against(existing_run)
    assert_one_line_error(code, out, err, expected)
    assert snapshot(existing_run) == before


# Read when the process first uses a device or compiles: a child process each.
PROCESS_ENVIRONMENTS = {
    "platform_unknown": ({"TPU_TRAIN_PLATFORM": "bogus"}, "is not a known platform"),
    "platform_tpu_without_tpu": ({"TPU_TRAIN_PLATFORM": "tpu"}, "but JAX finds no tpu devices"),
    "platform_cuda_without_gpu": ({"TPU_TRAIN_PLATFORM": "cuda"}, "but JAX finds no cuda devices"),
    # A TPU host (here: GKE's variable for it) where JAX has no TPU: not the host CPU, silently.
    "tpu_host_without_usable_tpu": ({"TPU_TRAIN_PLATFORM": "", "TPU_ACCELERATOR_TYPE": "v5litepod-16"},
                                    "this host has TPU chips (TPU_ACCELERATOR_TYPE=v5litepod-16) "
                                    "but JAX cannot use them"),
    "cache_dir_under_a_file": ({"TPU_TRAIN_CACHE_DIR": "BLOCKER/cache"},
                               "cannot create the compilation cache directory"),
    "cache_size_not_a_number": ({"TPU_TRAIN_CACHE_DIR": "TMP/cache", "TPU_TRAIN_CACHE_MAX_GB": "lots"},
                                "TPU_TRAIN_CACHE_MAX_GB='lots' is not a positive number"),
    "eager_mode_unknown": ({"TPU_TRAIN_EAGER_MODE": "bogus"},
                           "TPU_TRAIN_EAGER_MODE='bogus' is not an eager mode"),
    "strict_record_unknown": ({"TPU_TRAIN_STRICT_RECORD": "forward"},
                              "TPU_TRAIN_STRICT_RECORD='forward' is not a recording"),
}


# Cases that take the host for one without usable TPU chips.
NO_CHIPS = {"platform_tpu_without_tpu", "tpu_host_without_usable_tpu"}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.host_without_chips if name in NO_CHIPS else ())
    for name in sorted(PROCESS_ENVIRONMENTS)])
def test_bad_process_environment(name, tmp_path):
    variables, expected = PROCESS_ENVIRONMENTS[name]
    blocker, runs = tmp_path / "blocker", tmp_path / "runs"
    blocker.write_text("not a directory")
    runs.mkdir()
    # On the cpu platform unless the case names one: on a TPU host this process holds the chip.
    env = cpu_child_env(OMP_NUM_THREADS="1")
    # TMP: a cache directory of its own (creating an empty one is not writing a run).
    env.update({key: value.replace("BLOCKER", str(blocker)).replace("TMP", str(tmp_path))
                for key, value in variables.items()})
    done = subprocess.run([sys.executable, "-m", "tpu_train.cli", *TINY, "trainer.device=tpu",
                           "trainer.mode=compiled", "data.batch_size=8", "trainer.max_steps=1",
                           f"run.dir={runs / 'run'}"],
                          env=env, capture_output=True, text=True, timeout=180)
    assert_one_line_error(done.returncode, done.stdout, done.stderr, expected)
    assert not any(runs.iterdir()) and blocker.read_text() == "not a directory"
