"""``tpu-train`` answers ``--help``, a typo or a bad value before it imports torch, JAX or
transformers, and imports them (registering the ``tpu`` device) before a recipe runs; any
other ``import tpu_train`` registers the device at once (tpu_train.startup).
The time this saves is measured by scripts/bench_cli_startup.py, not here."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.platforms import cpu_child_env
from tests.trainer.cli_helpers import ROOT

HEAVY = ("torch", "jax", "transformers", "datasets")

# (arguments, exit status, what its one line of stderr starts with; None: no stderr)
ANSWERED_BEFORE_THE_IMPORTS = [
    (["trainer.max_step=10"], 2, "tpu-train: error: unknown key 'trainer.max_step'"),
    (["trainer.max_steps=many"], 2, "tpu-train: error: bad value for 'trainer.max_steps'"),
    (["optim.lr=-1"], 2, "tpu-train: error: optim.lr must be > 0, got -1.0"),
    (["model.name=llama3"], 2, "tpu-train: error: model.name='llama3' is not a known model"),
    (["data=jsonl", "data.path=no_such.jsonl"], 2,
     "tpu-train: error: data.path='no_such.jsonl' does not exist"),
    (["recipe.name=nope"], 2, "tpu-train: error: recipe.name='nope' is not a recipe"),
    (["model=llama9"], 2, "tpu-train: error: unknown model option 'llama9'"),
    (["--help"], 0, None),
    (["--cfg", "job"], 0, None),
]

# Runs each command in turn in one interpreter (as tests/trainer/cli_helpers.run_in_process
# does) and prints, per command, its exit status, its stderr and the heavy modules loaded so far.
_RUN_EACH = """\
import contextlib, io, json, runpy, sys
commands, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.argv = ["tpu-train", *commands[0]]
import tpu_train.cli as cli
for args in commands:
    sys.argv, err, code = ["tpu-train", *args], io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            cli.main()
    except SystemExit as exc:
        code = exc.code
    print(json.dumps([code, err.getvalue(), [m for m in heavy if m in sys.modules]]))
"""


def _child_env() -> dict[str, str]:
    """On the cpu platform (on a TPU host this process holds the chip), one process."""
    env = cpu_child_env(ROOT, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return env


def test_help_typos_and_bad_values_are_answered_before_torch_or_jax_is_imported(tmp_path):
    commands = [args for args, _, _ in ANSWERED_BEFORE_THE_IMPORTS]
    done = subprocess.run(
        [sys.executable, "-c", _RUN_EACH, json.dumps(commands), json.dumps(HEAVY)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == len(commands), done.stdout
    for (args, status, line), (code, err, loaded) in zip(ANSWERED_BEFORE_THE_IMPORTS, results):
        assert code == status, (args, err)
        if line is None:
            assert err == "", (args, err)
        else:
            assert len(err.splitlines()) == 1 and err.startswith(line), (args, err)
        assert loaded == [], f"tpu-train {' '.join(args)} imported {loaded} before answering"
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_valid_command_registers_the_device_before_the_recipe_runs(tmp_path):
    # A user's recipe script (the shipped ones train: seconds more) sees what `import
    # tpu_train` gives every program: the tpu device registered, tpu_train.device callable.
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text(
        "import sys\n"
        "def main(cfg):\n"
        "    import torch, tpu_train\n"
        "    x = torch.arange(3.0, device=tpu_train.device(0)) * 2\n"
        "    print('recipe:', x.cpu().tolist(), x.device)\n")
    done = subprocess.run([sys.executable, "-m", "tpu_train.cli", f"recipe={recipe}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=_child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "recipe: [0.0, 2.0, 4.0] tpu:0" in done.stdout


def test_importing_tpu_train_anywhere_else_registers_the_device_at_once():
    done = subprocess.run(
        [sys.executable, "-c",
         "import sys, tpu_train\n"
         "print(sorted(m for m in ('torch', 'jax') if m in sys.modules))\n"
         "import torch\n"
         "print(torch.ones(2, device='tpu').cpu().tolist(), callable(tpu_train.device))\n"],
        capture_output=True, text=True, timeout=300, env=_child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["['jax', 'torch']", "[1.0, 1.0] True"]
