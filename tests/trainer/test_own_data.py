"""Fine-tuning on a user's own JSONL without ``data.val_path``: a seeded held-out split is
validated on, before and after, and the log says so; and ``recipe=generate``'s docstring command,
run as a shell would pass it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.trainer.cli_helpers import TINY, one_thread, run_in_process  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def _records(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"add {i}+{i}", "response": str(2 * i)}) + "\n"
                            for i in range(count)))
    return path


def _validating(*extra: str) -> list[str]:
    return [*TINY, "data=jsonl", "trainer.max_steps=2", "trainer.val_every_n_steps=2",
            "trainer.val_batches=1", "recipe.eval.exact_match_examples=4",
            "recipe.eval.max_new_tokens=4", "data.seq_len=64", *extra]


def test_own_jsonl_without_val_path_reports_base_to_final_on_a_held_out_split(tmp_path):
    from tpu_train.data.sources import DataFiles, Holdout
    from tpu_train.trainer.builders import HOLDOUT_SEED

    data = _records(tmp_path / "train.jsonl", 400)
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*_validating(f"data.path={data}", f"run.dir={run_dir}"))
    assert code == 0, err
    assert "note: validation: 2% of data.path's records held out" in out
    held = DataFiles.of(data).with_options(holdout=Holdout(0.02, held_out=True, seed=HOLDOUT_SEED))
    count = sum(len(chunk) for chunk in held.read(0))
    assert 1 <= count < 40
    found = re.search(r"validation at step 2: exact match [0-9.]+% -> [0-9.]+% on (\d+) held-out "
                      r"examples, loss ([0-9.]+) -> ([0-9.]+), first figure: the starting model", out)
    assert found, out
    assert int(found[1]) == min(4, count)
    assert "data.template=auto: default" in (run_dir / "train.log").read_text()


def test_too_few_records_for_a_split_train_on_all_and_say_so(tmp_path):
    data = _records(tmp_path / "small.jsonl", 40)
    code, out, err = run_in_process(*_validating(f"data.path={data}", f"run.dir={tmp_path / 'run'}"))
    assert code == 0, err
    assert "note: no validation: data.path has too few records to hold out 2%" in out
    assert "validation at step" not in out


def _docstring_command() -> str:
    """The first ``tpu-train`` command of recipes/generate.py's docstring, continuation
    lines included, exactly as written there."""
    import recipes.generate

    lines = recipes.generate.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("tpu-train "))
    end = start
    while lines[end].endswith("\\"):
        end += 1
    return "\n".join(lines[start:end + 1]).strip()


def test_the_generate_docstring_command_sends_a_newline(tmp_path, monkeypatch):
    """``\\n`` typed in a single-quoted override reaches the recipe as backslash + n (bash and
    Hydra pass it on); the recipe makes it the newline the bundled task's prompts end with."""
    from tpu_train.data.tokenizer import load_tokenizer
    from tpu_train.trainer.config import asset_path

    stamp = "2026-01-01_00-00-00"
    command = _docstring_command().replace("<stamp>", stamp)
    # The user's shell splits the command: bash itself, with tpu-train swapped for printf.
    assert command.startswith("tpu-train ")
    split = subprocess.run(["bash", "-c", "printf '%s\\0' " + command[len("tpu-train "):]],
                           capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    assert 'recipe.generate.prompts=["add 12+30\\n"]' in split  # a backslash and an n
    # The export of a fine-tuning run where the command looks for it (the bundled base model
    # and tokenizer, in the layout a run's hf/ has).
    monkeypatch.chdir(tmp_path)
    export = tmp_path / "runs" / "llama_finetune" / stamp / "hf"
    shutil.copytree(asset_path("base_model"), export)
    load_tokenizer().save_pretrained(export)
    code, out, err = run_in_process(*split)
    assert code == 0, err
    assert "--- prompt: 'add 12+30\\n'" in out, out  # repr of a real newline
