"""Prompt/response templates (``data.template``) and the seeded held-out split (``data.holdout``)
as the readers apply them: what a record becomes, that training and evaluation see the same
prompt, and that the two sides of a split part the records."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tpu_train.data import PaddedInstructionLoader
from tpu_train.data.datasets import (ALPACA_TEMPLATE, DEFAULT_TEMPLATE, Example, encode_examples,
                                     parse_fields, resolve_template)
from tpu_train.data.sources import DataFiles, Holdout
from tpu_train.data.streams import FileStream

RECORD = {"prompt": "add 12+30", "response": "42"}
HERE = Path("data.jsonl")


def test_none_joins_prompt_and_response_as_they_are():
    assert parse_fields(RECORD, HERE, 1, template="none") == Example(
        "instruction", prompt="add 12+30", response="42")


def test_default_puts_instruction_and_response_headers_between_them(tokenizer):
    example = parse_fields(RECORD, HERE, 1, template="default")
    assert example.prompt == "### Instruction:\nadd 12+30\n\n### Response:\n" == DEFAULT_TEMPLATE.format(
        prompt="add 12+30")
    sample = encode_examples(tokenizer, [example])[0]
    prompt_ids, response_ids = tokenizer.encode(example.prompt), tokenizer.encode("42")
    assert list(sample.ids) == [tokenizer.bos_id, *prompt_ids, *response_ids, tokenizer.eos_id]
    assert list(sample.targets) == [False] * (1 + len(prompt_ids)) + [True] * (len(response_ids) + 1)


def test_an_alpaca_record_keeps_its_own_layout_under_default():
    record = {"instruction": "add 12+30", "output": "42"}
    expected = ALPACA_TEMPLATE.format(instruction="add 12+30")
    assert parse_fields(record, HERE, 1, template="default").prompt == expected
    assert parse_fields(record, HERE, 1, template="none").prompt == expected


def test_chat_makes_a_user_and_an_assistant_message():
    assert parse_fields(RECORD, HERE, 1, template="chat") == Example(
        "chat", messages=(("user", "add 12+30"), ("assistant", "42")))
    alpaca = {"instruction": "add", "input": "12+30", "output": "42"}
    assert parse_fields(alpaca, HERE, 1, template="chat").messages == (
        ("user", "add\n\n12+30"), ("assistant", "42"))


def test_auto_is_the_chat_template_when_the_tokenizer_has_one(tokenizer):
    assert tokenizer.chat_template is None
    assert resolve_template("auto", tokenizer) == "default"
    with_template = copy.copy(tokenizer)
    with_template.chat_template = "{{ messages }}"
    assert resolve_template("auto", with_template) == "chat"
    assert resolve_template("none", with_template) == "none"
    with pytest.raises(ValueError, match="choose from auto, chat, default, none"):
        resolve_template("alpaca", tokenizer)


@pytest.mark.parametrize("template", ["none", "default", "chat"])
def test_exact_match_prompts_are_the_prefix_training_saw(template, tokenizer, write_jsonl):
    """Evaluation decodes from the same prompt the model was trained to answer."""
    path = write_jsonl([RECORD, {"prompt": "sort c a b", "response": "a b c"}])
    files = DataFiles.of(path).with_options(template=template)
    stream = FileStream(files, tokenizer, "auto", mask_prompt=True, num_epochs=1, read_chunk=8)
    samples = [stream.take(), stream.take()]
    batch = next(iter(PaddedInstructionLoader(files, tokenizer, batch_size=2)))
    for row, sample in enumerate(samples):
        length = int(batch["prompt_lengths"][row])
        prompt = batch["prompt_tokens"][row, -length:].tolist()
        assert list(sample.ids[:length]) == prompt
        # Every token after the prompt is a target (a chat's closing <eos> only separates
        # packed samples: its turn ended with <eot>, the target).
        assert not any(sample.targets[:length]) and all(sample.targets[length:-1])
    assert batch["references"] == ["42", "a b c"]


def _lines(files: DataFiles) -> list[int]:
    return [loc.line for index in range(len(files.paths)) for chunk in files.read(index) for loc in chunk]


def test_the_two_sides_of_a_holdout_part_the_records(write_jsonl):
    path = write_jsonl([{"text": f"record {i}"} for i in range(2000)])
    files = DataFiles.of(path)
    held = _lines(files.with_options(holdout=Holdout(0.02, held_out=True)))
    kept = _lines(files.with_options(holdout=Holdout(0.02, held_out=False)))
    assert sorted(held + kept) == list(range(1, 2001)) and not set(held) & set(kept)
    # About 2 % (40 expected; the binomial's standard deviation is 6.3).
    assert 15 <= len(held) <= 65, len(held)
    # Seeded: the same split on every read, another with another seed.
    assert _lines(files.with_options(holdout=Holdout(0.02, held_out=True))) == held
    assert _lines(files.with_options(holdout=Holdout(0.02, held_out=True, seed=1))) != held


def test_a_resumed_stream_keeps_to_its_side(tokenizer, write_jsonl):
    path = write_jsonl([{"text": f"record {i}"} for i in range(300)])
    files = DataFiles.of(path).with_options(holdout=Holdout(0.5, held_out=False))
    whole = FileStream(files, tokenizer, "auto", True, num_epochs=1, read_chunk=7)
    samples = [whole.take() for _ in range(20)]
    resumed = FileStream(files, tokenizer, "auto", True, num_epochs=1, read_chunk=7)
    for _ in range(10):
        resumed.take()
    middle = FileStream(files, tokenizer, "auto", True, num_epochs=1, read_chunk=7)
    middle.load(resumed.state())
    assert [middle.take() for _ in range(10)] == samples[10:]
