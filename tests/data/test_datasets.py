from __future__ import annotations

import pytest

from tpu_train.data.datasets import ALPACA_INPUT_TEMPLATE, ALPACA_TEMPLATE, encode_examples, read_records
from tpu_train.data.errors import DataError


def examples_of(path, fmt="auto"):
    return [loc.example for chunk in read_records(path, fmt) for loc in chunk]


def test_each_record_format_is_recognised(write_jsonl):
    path = write_jsonl(
        [
            {"text": "plain text"},
            {"prompt": "add 1+2\n", "response": "3"},
            {"instruction": "Say hi.", "output": "hi"},
            {"instruction": "Reverse.", "input": "a b", "output": "b a"},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        ]
    )
    text, instruction, alpaca, alpaca_input, chat = examples_of(path)
    assert (text.kind, text.text) == ("text", "plain text")
    assert (instruction.kind, instruction.prompt, instruction.response) == ("instruction", "add 1+2\n", "3")
    assert alpaca.prompt == ALPACA_TEMPLATE.format(instruction="Say hi.") and alpaca.response == "hi"
    assert alpaca_input.prompt == ALPACA_INPUT_TEMPLATE.format(instruction="Reverse.", input="a b")
    assert chat.kind == "chat" and chat.messages == (("user", "hi"), ("assistant", "hello"))


def test_plain_text_file_is_one_sample_per_line(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("first line\n\nsecond line\n")
    assert [e.text for e in examples_of(path)] == ["first line", "second line"]


def test_positions_allow_resuming_mid_file(write_jsonl):
    path = write_jsonl([{"text": f"record {i}"} for i in range(10)])
    located = [loc for chunk in read_records(path, chunk_lines=3) for loc in chunk]
    assert [loc.line for loc in located] == list(range(1, 11))
    resumed = [loc.example.text for chunk in read_records(path, offset=located[3].end_offset, line=4) for loc in chunk]
    assert resumed == [f"record {i}" for i in range(4, 10)]


def test_encode_text_and_instruction_masks(tokenizer):
    from tpu_train.data.datasets import Example

    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    text, instruction = encode_examples(
        tokenizer, [Example("text", text="hello world"), Example("instruction", prompt="add 1+2\n", response="3")]
    )
    assert list(text.ids) == [bos] + tokenizer.encode("hello world") + [eos]
    assert text.targets == (False,) + (True,) * (len(text.ids) - 1)
    prompt = tokenizer.encode("add 1+2\n")
    assert list(instruction.ids) == [bos] + prompt + tokenizer.encode("3") + [eos]
    assert instruction.targets == (False,) * (1 + len(prompt)) + (True, True)
    (unmasked,) = encode_examples(tokenizer, [Example("instruction", prompt="add 1+2\n", response="3")], mask_prompt=False)
    assert unmasked.targets == (False,) + (True,) * (len(unmasked.ids) - 1)


def test_chat_sample_targets_are_assistant_turns(tokenizer, write_jsonl):
    path = write_jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}])
    (sample,) = encode_examples(tokenizer, examples_of(path))
    assert sample.ids[-1] == tokenizer.eos_id and not sample.targets[-1]
    assert tokenizer.decode([i for i, t in zip(sample.ids, sample.targets) if t]) == "hello<|eot_id|>"


# -- errors name the file and the line ------------------------------------------------------


def test_malformed_json_names_file_and_line(write_jsonl):
    path = write_jsonl([{"text": "ok"}, {"text": "ok"}, '{"text": "broken'])
    with pytest.raises(DataError, match=rf"{path}:3: malformed JSON") as info:
        examples_of(path)
    assert info.value.line == 3 and info.value.path == str(path)


def test_non_object_line_names_file_and_line(write_jsonl):
    path = write_jsonl([{"text": "ok"}, "[1, 2]"])
    with pytest.raises(DataError, match=rf"{path}:2: expected a JSON object"):
        examples_of(path)


def test_missing_field_names_the_field_and_accepted_fields(write_jsonl):
    path = write_jsonl([{"prompt": "p", "response": "r"}, {"prompt": "only a prompt"}])
    with pytest.raises(DataError, match=rf"{path}:2: missing field 'response'.*accepted fields: 'text'.*'messages'"):
        examples_of(path)
    path = write_jsonl([{"content": "x"}], name="unknown.jsonl")
    with pytest.raises(DataError, match=rf"{path}:1: no recognised fields \(record has 'content'\); accepted fields"):
        examples_of(path)
    path = write_jsonl([{"text": "x"}], name="forced.jsonl")
    with pytest.raises(DataError, match=rf"{path}:1: missing field 'messages'"):
        examples_of(path, fmt="chat")


def test_wrong_field_types_name_file_and_line(write_jsonl):
    path = write_jsonl([{"text": 5}])
    with pytest.raises(DataError, match=rf"{path}:1: field 'text' must be a string"):
        examples_of(path)
    path = write_jsonl([{"messages": [{"role": "user", "content": "x"}]}], name="chat.jsonl")
    with pytest.raises(DataError, match=rf"{path}:1: a chat record needs .*assistant"):
        examples_of(path)
    path = write_jsonl([{"messages": [{"role": "bot", "content": "x"}]}], name="chat2.jsonl")
    with pytest.raises(DataError, match=rf"{path}:1: messages\[0\] has role 'bot'; accepted roles"):
        examples_of(path)


def test_empty_and_missing_files(tmp_path, write_jsonl):
    empty = write_jsonl(["", "   "])
    with pytest.raises(DataError, match=rf"{empty}: data file is empty"):
        examples_of(empty)
    missing = tmp_path / "absent.jsonl"
    with pytest.raises(DataError, match=rf"{missing}: data file not found"):
        examples_of(missing)


def test_unknown_format_is_rejected(write_jsonl):
    with pytest.raises(ValueError, match="unknown data format 'csv'"):
        examples_of(write_jsonl([{"text": "x"}]), fmt="csv")
