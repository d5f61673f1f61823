"""The trainer's seams stay single (docs/architecture.md, "One path through the trainer"):
what differs between layouts lives in one class per layout, never in string tests; trainer
functions take a few values (the run, the layout, a settings value), not bags of arguments;
the training recipes are the steps of training, not their wiring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_PARAMETERS = 5
MAX_RECIPE_LINES = 40


def test_no_layout_string_tests():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in sorted((ROOT / "tpu_train").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"layout (==|!=)", line)]
    assert not found, "branch on the Layout class's methods instead:\n" + "\n".join(found)


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = function.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [f"*{a.arg}" for a in (args.vararg, args.kwarg) if a is not None]
    return [name for name in names if name not in ("self", "cls")]


def test_trainer_functions_take_at_most_five_parameters():
    wide = []
    for path in sorted((ROOT / "tpu_train" / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = _parameters(node)
                if len(names) > MAX_PARAMETERS:
                    wide.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}{names}")
    assert not wide, "\n".join(wide)


def test_training_recipes_are_short():
    for name in ("llama_pretrain", "llama_finetune", "llama_lora"):
        lines = (ROOT / "recipes" / f"{name}.py").read_text().splitlines()
        assert len(lines) <= MAX_RECIPE_LINES, f"recipes/{name}.py has {len(lines)} lines"
