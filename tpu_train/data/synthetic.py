"""A synthetic instruction task small models can learn quickly, with an exact-match metric.

Three sub-tasks, each a one-line prompt ending in a newline and a short response:

=========  ========================  ===========
task       prompt                    response
=========  ========================  ===========
add        ``add 73+45\\n``          ``811``
reverse    ``reverse c a t\\n``      ``t a c``
sort       ``sort d b a\\n``         ``a b d``
=========  ========================  ===========

Letters are space separated so that each is one token of a byte-level BPE; digits are single
tokens in the bundled tokenizer. Responses are at most 11 characters (< 20 tokens).

Addition: operands are 0 to 99 (:data:`ADD_MAX_OPERAND`), written with two digits
(``add 07+45``), and the sum is written with three digits, **least-significant digit first**
(73 + 45 = 118 is answered ``811``; 7 + 5 = 12 is answered ``210``). This is part of the task
definition, not a formatting detail: written least-significant digit first, each answer digit
depends on the two operand digits of its column and on the carry out of the column just written,
so a left-to-right model can add column by column; written most-significant digit first, the
first digit already needs the carry of every column below it. Fixed widths put every operand
digit and answer digit at the same position in every example. With the sum written the usual way
(unpadded, most-significant digit first) the embedded default run answered about a third of the
held-out sums correctly, mostly off by one in the last digit (docs/recipes.md has the figures);
the numbers involved, and so the arithmetic, are the same.

Splits are decided by a hash of the prompt, not by the seed: an example is held out iff its
prompt hashes into the held-out bucket, so train and held-out sets never overlap whatever the
seeds or sizes used to draw them.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from pathlib import Path
from typing import Iterator, Sequence

TASKS = ("add", "reverse", "sort")
SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 10
ADD_MAX_OPERAND = 99
ADD_OPERAND_DIGITS = 2
ADD_SUM_DIGITS = 3
END_MARKERS = ("<|end_of_text|>", "<|eot_id|>", "\n")


def split_of(prompt: str) -> str:
    """``"heldout"`` for the ~10 % of prompts whose hash lands in the held-out bucket, else ``"train"``."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:4], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def add_response(a: int, b: int) -> str:
    """The answer to ``add a+b``: the sum with :data:`ADD_SUM_DIGITS` digits, least-significant first."""
    if not (0 <= a <= ADD_MAX_OPERAND and 0 <= b <= ADD_MAX_OPERAND):
        raise ValueError(f"addition operands must be 0 to {ADD_MAX_OPERAND}: got {a} and {b}")
    return f"{a + b:0{ADD_SUM_DIGITS}d}"[::-1]


def add_prompt(a: int, b: int) -> str:
    """The prompt ``add a+b`` with each operand written with :data:`ADD_OPERAND_DIGITS` digits."""
    return f"add {a:0{ADD_OPERAND_DIGITS}d}+{b:0{ADD_OPERAND_DIGITS}d}\n"


def _letters(rng: random.Random) -> list[str]:
    return [rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6))]


def make_example(task: str, rng: random.Random) -> dict[str, str]:
    """One ``{"prompt", "response", "task"}`` example of ``task`` drawn with ``rng``."""
    if task == "add":
        a, b = rng.randint(0, ADD_MAX_OPERAND), rng.randint(0, ADD_MAX_OPERAND)
        return {"prompt": add_prompt(a, b), "response": add_response(a, b), "task": task}
    if task == "reverse":
        letters = _letters(rng)
        return {"prompt": f"reverse {' '.join(letters)}\n", "response": " ".join(reversed(letters)), "task": task}
    if task == "sort":
        letters = _letters(rng)
        return {"prompt": f"sort {' '.join(letters)}\n", "response": " ".join(sorted(letters)), "task": task}
    raise ValueError(f"unknown synthetic task {task!r}; choose from {', '.join(TASKS)}")


def iter_examples(split: str, seed: int, tasks: Sequence[str] = TASKS) -> Iterator[dict[str, str]]:
    """Endless stream of examples of ``split``, cycling through ``tasks``; deterministic by seed.

    Duplicates are possible (use :func:`generate_examples` for a de-duplicated set).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"unknown synthetic task {task!r}; choose from {', '.join(TASKS)}")
    rng = random.Random(f"synthetic:{seed}")
    index = 0
    while True:
        example = make_example(tasks[index % len(tasks)], rng)
        if split_of(example["prompt"]) == split:
            index += 1
            yield example


def generate_examples(n: int, split: str = "train", seed: int = 0, tasks: Sequence[str] = TASKS) -> list[dict[str, str]]:
    """``n`` distinct examples of ``split`` (tasks in equal shares), deterministic by ``seed``."""
    seen: set[str] = set()
    out = []
    for example in iter_examples(split, seed, tasks):
        if len(out) == n:
            break
        if example["prompt"] not in seen:
            seen.add(example["prompt"])
            out.append(example)
    return out


def write_jsonl(path: str | Path, examples: Sequence[dict[str, str]]) -> Path:
    """Write examples as instruction JSONL (one ``{"prompt", "response", "task"}`` per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example, ensure_ascii=False) + "\n")
    return path


def extract_response(generated: str, prompt: str | None = None) -> str:
    """The response part of generated text.

    Drops ``prompt`` if the text starts with it, then cuts at the first end marker
    (``<|end_of_text|>``, ``<|eot_id|>`` or a newline) and strips surrounding whitespace.
    """
    text = generated
    for marker in ("<|begin_of_text|>",):
        if text.startswith(marker):
            text = text[len(marker) :]
    if prompt is not None and text.startswith(prompt):
        text = text[len(prompt) :]
    text = text.lstrip()
    cut = len(text)
    for marker in END_MARKERS:
        position = text.find(marker)
        if position != -1:
            cut = min(cut, position)
    return text[:cut].strip()


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of predictions equal to their reference after stripping whitespace at both ends."""
    if len(predictions) != len(references):
        raise ValueError(
            f"exact_match needs one prediction per reference: got {len(predictions)} predictions "
            f"and {len(references)} references"
        )
    if not references:
        raise ValueError("exact_match needs at least one reference")
    hits = sum(p.strip() == r.strip() for p, r in zip(predictions, references))
    return hits / len(references)
