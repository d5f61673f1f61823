"""``tpu-train`` opens the backend while it imports torch, once its configuration is valid
(tpu_train.startup): only for a single-process run of a recipe, and an error found meanwhile
still ends the command at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tpu_train import startup

TRAINING_RUNS = [[], ["trainer.max_steps=5", "recipe=llama_lora"], ["trainer.device=tpu"],
                 ["recipe=./my_recipe.py", "+trainer.seed=3", "run.dir=latest"]]
NO_EARLY_OPEN = {
    "the planner": ["plan", "model=llama3_1_8b"],
    "the planner as a recipe": ["parallel.fsdp=8", "recipe=plan"],
    "help": ["--help"],
    "the composed config": ["--cfg", "job"],
    "a multirun": ["-m", "trainer.seed=1,2"],
    "a run on the host CPU": ["trainer.device=cpu"],
    "a Hydra setting": ["hydra.verbose=true"],
    "a deleted key": ["~trainer.max_steps"],
    "an override without a value": ["trainer.max_steps"],
    "an override without a key": ["=3"],
}


@pytest.mark.parametrize("args", TRAINING_RUNS)
def test_a_single_process_training_run_opens_early(args):
    assert startup.opens_a_device_early(args, {})
    assert startup.opens_a_device_early(args, {"WORLD_SIZE": "1"})


@pytest.mark.parametrize("world_size", ["2", "8", "two"])
def test_a_launcher_s_processes_never_open_early(world_size):
    # jax.distributed must start (in the trainer's start_processes) before any backend does.
    assert not startup.opens_a_device_early([], {"WORLD_SIZE": world_size})


@pytest.mark.parametrize("case", sorted(NO_EARLY_OPEN))
def test_commands_that_run_no_recipe_on_the_device_do_not_open_early(case):
    assert not startup.opens_a_device_early(NO_EARLY_OPEN[case], {})


def test_the_command_is_recognized_as_the_console_script_or_the_module():
    assert startup.command_arguments(["/venv/bin/tpu-train", "a=1"], ["/venv/bin/python",
                                      "/venv/bin/tpu-train", "a=1"]) == ["a=1"]
    # While ``python -m`` imports the package, sys.argv[0] is "-m".
    assert startup.command_arguments(["-m", "a=1"], ["python", "-X", "importtime", "-m",
                                      "tpu_train.cli", "a=1"]) == ["a=1"]
    assert startup.command_arguments(["train.py", "a=1"], ["python", "train.py", "a=1"]) is None
    assert startup.command_arguments(["-m", "--nproc", "2"], ["python", "-m", "tpu_train.launch",
                                      "--nproc", "2"]) is None


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**environ, "OMP_NUM_THREADS": "1", **env})


# The command's own process: ``import tpu_train`` defers torch, JAX and the backend until the
# configuration is valid; then the command loads the runtime (startup.load_runtime).
_IMPORT_AS_THE_COMMAND = (
    "import sys\n"
    "sys.argv = ['tpu-train', *sys.argv[1:]]\n"
    "import tpu_train\n"
    "deferred = not {'torch', 'jax'} & set(sys.modules)\n"
    "from tpu_train import startup\n"
    "startup.load_runtime()\n"
    "from tpu_train.device import runtime\n"
    "print(deferred, startup.opened_early(), runtime.opening() or runtime.devices_enumerated())\n")


@pytest.mark.parametrize("args, world_size, opens", [
    ([], None, True), (["trainer.max_steps=3"], "1", True),
    ([], "2", False),  # a launcher's process: jax.distributed first
    (["plan", "model=llama3_1_8b"], None, False),
    (["=3"], None, False),  # an error of the command line itself
])
def test_loading_the_command_s_runtime_opens_the_backend_only_for_a_training_run(
        args, world_size, opens):
    done = _python(_IMPORT_AS_THE_COMMAND.replace("*sys.argv[1:]", ", ".join(map(repr, args))),
                   **({"WORLD_SIZE": world_size} if world_size else {}))
    assert done.returncode == 0, done.stderr[-2000:]
    # Not opened early: no backend at all yet (the trainer opens it, after the processes join).
    assert done.stdout.split() == ["True", str(opens), str(opens)]


def _command_with_a_backend_that_never_opens(*args: str) -> subprocess.CompletedProcess:
    """``tpu-train args`` where opening the backend never ends (a chip that hangs); it prints
    ``opening`` when it starts."""
    return _python("import os, sys, threading\n"
                   "import jax\n"
                   "def never_opens(*args, **kwargs):\n"
                   "    print('opening', flush=True)\n"
                   "    os.write(2, b'native start-up noise\\n')\n"
                   "    threading.Event().wait()\n"
                   "jax.devices = never_opens\n"
                   f"sys.argv = ['tpu-train', *{list(args)!r}]\n"
                   "import runpy\n"
                   "runpy.run_module('tpu_train.cli', run_name='__main__')\n")


def test_an_error_found_while_the_backend_opens_ends_the_command_without_waiting(tmp_path):
    # A recipe's own check (llama_pretrain refuses a model.checkpoint) runs once the runtime is
    # loaded, when the backend is opening: the error must still come, as one line, with exit
    # status 2, and nothing written. A wait for the open would hang until the timeout. What
    # the native start-up printed meanwhile is dropped, as for an open that fails.
    base = tmp_path / "base"
    base.mkdir()
    done = _command_with_a_backend_that_never_opens(
        "recipe=llama_pretrain", f"model.checkpoint={base}", f"run.dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout == "opening\n"  # the backend was opening when the error was found
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpu-train: error: recipe=llama_pretrain ")
    assert list(tmp_path.iterdir()) == [base]


def test_a_config_error_is_reported_before_the_backend_starts_opening(tmp_path):
    done = _command_with_a_backend_that_never_opens("trainer.max_steps=many",
                                                    f"run.dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout == ""  # never started opening
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpu-train: error: ") and "max_steps" in lines[0]
    assert not any(tmp_path.iterdir())


def test_a_recipe_that_runs_on_the_host_cpu_after_an_early_open_runs(tmp_path):
    # The command line cannot tell: the recipe itself moves the run to torch's CPU device,
    # after the backend started opening. The run goes on, on the CPU, and ends normally.
    from importlib import resources

    from tests.trainer.cli_helpers import TINY

    from tpu_train import cli

    source = resources.files(cli.RECIPES_PACKAGE) / "llama_finetune.py"
    mine = tmp_path / "cpu_recipe.py"
    mine.write_text(source.read_text().replace(
        "    job = trainer.start(cfg)",
        "    from tpu_train import startup\n"
        "    print('opened early:', startup.opened_early())\n"
        "    cfg.trainer.device = 'cpu'\n"
        "    job = trainer.start(cfg)"))
    overrides = [o for o in TINY if not o.startswith("trainer.device=")]
    done = subprocess.run(
        [sys.executable, "-m", "tpu_train.cli", f"recipe={mine}", *overrides,
         "trainer.max_steps=1", f"run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "WORLD_SIZE"} | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "opened early: True" in done.stdout
    assert "device: cpu |" in done.stdout and "finished step 1/1" in done.stdout
