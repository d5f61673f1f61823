from __future__ import annotations

import pytest
import tokenizers

from tpu_train.data.chat import format_chat
from tpu_train.data.errors import DataError
from tpu_train.data.tokenizer import default_tokenizer_path

MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "  reverse c a t \n"},
    {"role": "assistant", "content": "t a c"},
    {"role": "user", "content": "sort b a"},
    {"role": "assistant", "content": "a b"},
]


def render(messages, generation_prompt=False):
    """The Llama 3 chat string, written out by hand."""
    text = "<|begin_of_text|>"
    for m in messages:
        text += f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
    if generation_prompt:
        text += "<|start_header_id|>assistant<|end_header_id|>\n\n"
    return text


@pytest.fixture(scope="module")
def library_tokenizer():
    # The library parses special-token text itself here: an independent encoding of the string.
    return tokenizers.Tokenizer.from_file(str(default_tokenizer_path()))


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_ids_match_the_rendered_string(tokenizer, library_tokenizer, generation_prompt):
    chat = format_chat(tokenizer, MESSAGES, add_generation_prompt=generation_prompt)
    expected = library_tokenizer.encode(render(MESSAGES, generation_prompt), add_special_tokens=False).ids
    assert chat.ids == expected
    assert len(chat.target_mask) == len(chat.ids)


def test_only_assistant_content_and_its_eot_are_targets(tokenizer):
    chat = format_chat(tokenizer, MESSAGES)
    eot = tokenizer.special_ids["<|eot_id|>"]
    targets = [i for i, is_target in zip(chat.ids, chat.target_mask) if is_target]
    assert tokenizer.decode(targets) == "t a c<|eot_id|>a b<|eot_id|>"
    # Each target run ends with <|eot_id|> and starts right after an assistant header.
    runs, current = [], []
    for i, is_target in zip(chat.ids, chat.target_mask):
        if is_target:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    runs.append(current)
    assert [r[-1] for r in runs] == [eot, eot]


def test_generation_prompt_has_no_targets_after_last_turn(tokenizer):
    chat = format_chat(tokenizer, MESSAGES[:2], add_generation_prompt=True)
    assert not any(chat.target_mask)
    assert tokenizer.decode(chat.ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_bad_messages_are_rejected(tokenizer):
    with pytest.raises(DataError, match="at least one message"):
        format_chat(tokenizer, [])
    with pytest.raises(DataError, match="role must be one of"):
        format_chat(tokenizer, [{"role": "robot", "content": "x"}])
    with pytest.raises(DataError, match="'role' and 'content'"):
        format_chat(tokenizer, [{"content": "x"}])
