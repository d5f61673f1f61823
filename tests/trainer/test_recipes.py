"""Recipes against committed golden loss curves.

Regenerate the golden files (after an intended change of the numerics) with::

    TPU_TRAIN_REGENERATE_GOLDEN=1 python -m pytest tests/trainer/test_recipes.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.trainer.cli_helpers import TINY, TINY_COMPILED, read_metrics, run_in_process
from tests.trainer.loss_bounds import GOLDEN_OVERRIDES, assert_matches_golden

GOLDEN_DIR = Path(__file__).parent / "golden"
REGENERATE = os.environ.get("TPU_TRAIN_REGENERATE_GOLDEN") == "1"
STEPS = 3


@pytest.mark.parametrize("recipe", ["llama_pretrain", "llama_finetune", "llama_lora"])
def test_training_recipe_matches_golden_losses(recipe, tmp_path):
    """Each training recipe with the compiled step on the tpu device (the schema's default)."""
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(f"recipe={recipe}", *TINY_COMPILED, *GOLDEN_OVERRIDES,
                                    f"trainer.max_steps={STEPS}", "checkpoint.export_hf=true",
                                    f"run.dir={run_dir}")
    assert code == 0, err
    losses = [read_metrics(run_dir)[step]["train/loss"] for step in range(1, STEPS + 1)]
    golden_file = GOLDEN_DIR / f"{recipe}.json"
    if REGENERATE:
        golden_file.write_text(json.dumps({"steps": STEPS, "losses": losses}, indent=2) + "\n")
    golden = json.loads(golden_file.read_text())
    assert golden["steps"] == STEPS
    assert_matches_golden(losses, golden["losses"], rows=8)  # TINY_COMPILED's 8-row batches
    assert (run_dir / "hf" / "config.json").is_file()


def test_lora_export_is_a_plain_model(tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    code, _, err = run_in_process("recipe=llama_lora", *TINY, "trainer.max_steps=1",
                                  "checkpoint.export_hf=true", f"run.dir={run_dir}")
    assert code == 0, err
    exported = {}
    for shard in (run_dir / "hf").glob("*.safetensors"):
        exported.update(load_file(str(shard)))
    assert exported and not any("lora" in key for key in exported)


def test_generate_and_eval_use_the_run_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    code, _, err = run_in_process(*TINY, "trainer.max_steps=1", f"run.dir={run_dir}")
    assert code == 0, err
    code, out, err = run_in_process("recipe=generate", f"run.dir={run_dir}",
                                    "recipe.generate.max_new_tokens=4", "recipe.generate.prompts=[add 1+2]")
    assert code == 0, err
    assert "step_00000001" in out and "--- prompt: 'add 1+2'" in out
    code, out, err = run_in_process("recipe=eval", f"run.dir={run_dir}", "recipe.eval.batches=1",
                                    "recipe.eval.exact_match_examples=2", "recipe.eval.max_new_tokens=4",
                                    "data.seq_len=32", "data.batch_size=2")
    assert code == 0, err
    assert "loss " in out and "perplexity " in out
    assert re.search(r"\| exact_match [0-9.]+ on 2 examples$", out.strip()), out
