from __future__ import annotations

import pytest
import torch

from tpu_train.data.errors import DataError
from tpu_train.data.packing import IGNORE_INDEX
from tpu_train.data.padded import PaddedInstructionLoader

RECORDS = [
    {"prompt": "add 12+30\n", "response": "42"},
    {"prompt": "reverse c a t\n", "response": "t a c"},
    {"instruction": "sort", "input": "b a", "output": "a b"},
]


def test_batches_keep_prompts_and_references(tokenizer, write_jsonl):
    loader = PaddedInstructionLoader(write_jsonl(RECORDS), tokenizer, batch_size=2)
    first, second = list(loader)
    assert first["references"] == ["42", "t a c"] and second["references"] == ["a b"]
    assert first["prompts"] == ["add 12+30\n", "reverse c a t\n"]
    bos, eos, pad = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
    for row, record in enumerate(RECORDS[:2]):
        prompt, response = tokenizer.encode(record["prompt"]), tokenizer.encode(record["response"])
        full = [bos] + prompt + response + [eos]
        width = first["tokens"].shape[1]
        # tokens: right-padded sample; labels: next token on the response and <eos> only.
        assert first["tokens"][row].tolist() == (full + [pad] * (width + 1 - len(full)))[:width]
        expected_labels = [IGNORE_INDEX] * len(prompt) + response + [eos]
        assert first["labels"][row].tolist() == expected_labels + [IGNORE_INDEX] * (width - len(expected_labels))
        # prompt_tokens: left-padded <bos> prompt, ready to generate from the last column.
        prompt_row = first["prompt_tokens"][row].tolist()
        assert prompt_row[len(prompt_row) - len(prompt) - 1 :] == [bos] + prompt
        assert first["prompt_lengths"][row].item() == len(prompt) + 1
        assert set(prompt_row[: len(prompt_row) - len(prompt) - 1]) <= {pad}
    assert all(v.dtype == torch.long for k, v in first.items() if isinstance(v, torch.Tensor))


def test_iterating_twice_gives_the_same_batches(tokenizer, write_jsonl):
    loader = PaddedInstructionLoader(write_jsonl(RECORDS), tokenizer, batch_size=3)
    a, b = list(loader), list(loader)
    assert len(a) == 1 and torch.equal(a[0]["tokens"], b[0]["tokens"])


def test_chat_records_prompt_is_history_and_reference_last_assistant_turn(tokenizer, write_jsonl):
    chat = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "sort b a"},
            {"role": "assistant", "content": "a b"},
        ]
    }
    (batch,) = list(PaddedInstructionLoader(write_jsonl([chat]), tokenizer, batch_size=4))
    assert batch["references"] == ["a b"]
    prompt_text = tokenizer.decode(batch["prompt_tokens"][0].tolist())
    assert prompt_text.endswith("sort b a<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    predicted = [t for t in batch["labels"][0].tolist() if t != IGNORE_INDEX]
    assert tokenizer.decode(predicted) == "a b<|eot_id|>"


def test_text_records_are_rejected_with_file_and_line(tokenizer, write_jsonl):
    path = write_jsonl([RECORDS[0], {"text": "no prompt here"}])
    with pytest.raises(DataError, match=rf"{path}:2: a text record has no prompt/response"):
        list(PaddedInstructionLoader(path, tokenizer, batch_size=2))
    with pytest.raises(ValueError, match="needs instruction or chat records"):
        PaddedInstructionLoader(path, tokenizer, batch_size=2, format="text")
