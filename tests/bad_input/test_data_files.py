"""Bad data and tokenizer files: each is one line naming the file (and the line where there is
one), exit 2, nothing written."""

from __future__ import annotations

import json

import pytest

from tests.bad_input.conftest import assert_one_line_error, run_against
from tests.trainer.cli_helpers import snapshot

pytestmark = pytest.mark.usefixtures("one_thread")

GOOD = '{"prompt": "a", "response": "b"}\n'


def _lines(*records) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


# file name: (content, extra overrides, text the error line must contain)
TRAINING_FILES = {
    "empty.jsonl": ("", [], "empty"),
    "blank_lines.jsonl": ("\n\n  \n", [], "blank_lines.jsonl"),
    "broken.jsonl": (GOOD + '{"prompt": \n', [], "broken.jsonl:2"),
    "nofield.jsonl": (_lines({"title": "no text here"}), [], "nofield.jsonl:1"),
    "notdict.jsonl": ("[1, 2, 3]\n", [], "notdict.jsonl:1"),
    "binary.jsonl": (b"\xff\xfe\x00\x81garbage\n", [], "binary.jsonl"),
    "text_not_string.jsonl": (_lines({"text": 5}), [], "text_not_string.jsonl:1"),
    "prompt_not_string.jsonl": (_lines({"prompt": ["a"], "response": "b"}), [],
                                "prompt_not_string.jsonl:1"),
    "messages_not_list.jsonl": (_lines({"messages": "hello"}), [], "messages_not_list.jsonl:1"),
    "message_without_role.jsonl": (_lines({"messages": [{"content": "hi"}]}), [],
                                   "message_without_role.jsonl:1"),
    "message_unknown_role.jsonl": (_lines({"messages": [{"role": "wizard", "content": "hi"}]}),
                                   [], "message_unknown_role.jsonl:1"),
    "message_content_not_string.jsonl": (
        _lines({"messages": [{"role": "user", "content": {"a": 1}}]}), [],
        "message_content_not_string.jsonl:1"),
    "text_as_instruction.jsonl": (_lines({"text": "plain"}), ["data.format=instruction"],
                                  "text_as_instruction.jsonl:1"),
    "instruction_as_chat.jsonl": (GOOD, ["data.format=chat"], "instruction_as_chat.jsonl:1"),
    "instruction_as_text.jsonl": (GOOD, ["data.format=text"], "instruction_as_text.jsonl:1"),
    "late_broken.jsonl": (GOOD * 5 + "{oops}\n", [], "late_broken.jsonl:6"),
}

# Validation files: the same checks, reported for data.val_path.
VALIDATION_FILES = {
    "val_broken.jsonl": (GOOD + "not json\n", "val_broken.jsonl:2"),
    "val_empty.jsonl": ("", "empty"),
}

TOKENIZERS = {
    "garbage_tokenizer.json": ("this is not a tokenizer", "garbage_tokenizer.json"),
    "wrong_json_tokenizer.json": ('{"model": 3}', "wrong_json_tokenizer.json"),
    "empty_dir": (None, "empty_dir"),
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    for name, (content, _, _) in TRAINING_FILES.items():
        write = (root / name).write_bytes if isinstance(content, bytes) else (root / name).write_text
        write(content)
    for name, (content, _) in VALIDATION_FILES.items():
        (root / name).write_text(content)
    (root / "good.jsonl").write_text(GOOD * 20)
    for name, (content, _) in TOKENIZERS.items():
        if content is None:
            (root / name).mkdir()
        else:
            (root / name).write_text(content)
    return root


@pytest.mark.parametrize("name", sorted(TRAINING_FILES))
def test_bad_training_file(name, existing_run, data_dir):
    _, extra, expected = TRAINING_FILES[name]
    before = snapshot(existing_run)
    code, out, err = run_against(existing_run, "data=jsonl", f"data.path={data_dir / name}", *extra)
    assert_one_line_error(code, out, err, expected)
    assert snapshot(existing_run) == before


@pytest.mark.parametrize("name", sorted(VALIDATION_FILES))
def test_bad_validation_file(name, existing_run, data_dir):
    _, expected = VALIDATION_FILES[name]
    before = snapshot(existing_run)
    code, out, err = run_against(existing_run, "data=jsonl", f"data.path={data_dir / 'good.jsonl'}",
                                 f"data.val_path={data_dir / name}", "trainer.val_every_n_steps=1")
    assert_one_line_error(code, out, err, expected)
    assert snapshot(existing_run) == before


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_bad_tokenizer(name, existing_run, data_dir):
    _, expected = TOKENIZERS[name]
    before = snapshot(existing_run)
    code, out, err = run_against(existing_run, f"data.tokenizer={data_dir / name}")
    assert_one_line_error(code, out, err, expected)
    assert snapshot(existing_run) == before
