from __future__ import annotations

import json
import random
import re

import pytest

from tpu_train.data.corpus import TASKS_HELDOUT, TASKS_TRAIN, default_corpus_dir
from tpu_train.data.synthetic import (
    SPLITS,
    TASKS,
    add_prompt,
    add_response,
    exact_match,
    extract_response,
    generate_examples,
    iter_examples,
    make_example,
    split_of,
    write_jsonl,
)


def solve(prompt: str) -> str:
    """An independent solver of the prompts, used as the oracle for responses."""
    task, _, rest = prompt.strip().partition(" ")
    if task == "add":
        a, b = rest.split("+")
        # Three digits, least-significant first.
        total = int(a) + int(b)
        return "".join(str(total // 10**i % 10) for i in range(3))
    letters = rest.split(" ")
    return " ".join(letters[::-1] if task == "reverse" else sorted(letters))


def test_responses_are_correct_and_short(tokenizer):
    examples = generate_examples(300, "train", seed=5)
    assert {e["task"] for e in examples} == set(TASKS)
    for example in examples:
        assert example["prompt"].endswith("\n")
        assert example["response"] == solve(example["prompt"])
        assert len(tokenizer.encode(example["response"])) < 20


def test_prompt_shapes():
    rng = random.Random(0)
    operands = set()
    for _ in range(200):
        add, rev, srt = (make_example(t, rng)["prompt"] for t in TASKS)
        assert re.fullmatch(r"add \d{2}\+\d{2}\n", add)
        operands.update(int(n) for n in add[4:].split("+"))
        assert re.fullmatch(r"reverse [a-z]( [a-z]){2,5}\n", rev)
        assert re.fullmatch(r"sort [a-z]( [a-z]){2,5}\n", srt)
    # Operands from 0 to 99, the one-digit ones written with a leading zero.
    assert min(operands) < 10 and max(operands) > 89
    with pytest.raises(ValueError, match="unknown synthetic task 'multiply'"):
        make_example("multiply", rng)


def test_addition_format():
    # Operands with two digits; the sum with three digits, least-significant digit first.
    assert add_prompt(73, 45) == "add 73+45\n" and add_response(73, 45) == "811"
    assert add_prompt(7, 5) == "add 07+05\n" and add_response(7, 5) == "210"
    assert add_response(99, 99) == "891" and add_response(0, 0) == "000" and add_response(50, 50) == "001"
    with pytest.raises(ValueError, match="operands must be 0 to 99: got 100 and 1"):
        add_response(100, 1)


def test_deterministic_by_seed():
    assert generate_examples(50, "train", seed=1) == generate_examples(50, "train", seed=1)
    assert generate_examples(50, "train", seed=1) != generate_examples(50, "train", seed=2)


def test_splits_never_overlap():
    train = {e["prompt"] for seed in range(3) for e in generate_examples(2000, "train", seed=seed)}
    heldout = {e["prompt"] for e in generate_examples(500, "heldout", seed=9)}
    assert len(heldout) == 500
    assert not train & heldout
    assert all(split_of(p) == "heldout" for p in heldout)


def test_bundled_splits_are_disjoint_from_every_training_text():
    corpus = default_corpus_dir()
    heldout = [json.loads(line) for line in (corpus / TASKS_HELDOUT).read_text().splitlines()]
    train = [json.loads(line) for line in (corpus / TASKS_TRAIN).read_text().splitlines()]
    heldout_prompts = {r["prompt"] for r in heldout}
    assert len(heldout_prompts) == len(heldout)
    assert not heldout_prompts & {r["prompt"] for r in train}
    pretrain_texts = [json.loads(line)["text"] for line in (corpus / "pretrain.jsonl").read_text().splitlines()]
    assert not any(text.split("\n")[0] + "\n" in heldout_prompts for text in pretrain_texts)
    assert all(r["response"] == solve(r["prompt"]) for r in heldout + train)


def test_iter_examples_validates_arguments():
    with pytest.raises(ValueError, match="unknown split 'test'"):
        next(iter_examples("test", 0))
    assert SPLITS == ("train", "heldout")


def test_write_jsonl_round_trips(tmp_path):
    examples = generate_examples(10, "heldout", seed=0)
    path = write_jsonl(tmp_path / "sub" / "x.jsonl", examples)
    assert [json.loads(line) for line in path.read_text().splitlines()] == examples


def test_exact_match():
    assert exact_match(["168", " t a c ", "a b"], ["168", "t a c", "a c"]) == pytest.approx(2 / 3)
    assert exact_match(["1"], ["1"]) == 1.0
    with pytest.raises(ValueError, match="one prediction per reference: got 1 predictions and 2"):
        exact_match(["1"], ["1", "2"])
    with pytest.raises(ValueError, match="at least one reference"):
        exact_match([], [])


def test_extract_response():
    prompt = "add 12+30\n"
    assert extract_response("42<|end_of_text|>junk", prompt) == "42"
    assert extract_response(prompt + "42<|end_of_text|><|begin_of_text|>add", prompt) == "42"
    assert extract_response("<|begin_of_text|>" + prompt + "42\nadd 1+1", prompt) == "42"
    assert extract_response(" t a c<|eot_id|>") == "t a c"
    assert extract_response("no end marker ") == "no end marker"
