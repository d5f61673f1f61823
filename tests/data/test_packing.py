from __future__ import annotations

import io
import itertools

import pytest
import torch

from tpu_train.data.errors import DataError
from tpu_train.data.packing import IGNORE_INDEX, PackedLoader


def text_records(n, start=0):
    return [{"text": f"record number {i} " + "word " * (i % 7)} for i in range(start, start + n)]


def expected_stream(tokenizer, texts):
    """The token stream packing must cut: <bos> text <eos> per record, and each id's target flag."""
    ids, targets = [], []
    for text in texts:
        body = tokenizer.encode(text)
        ids += [tokenizer.bos_id] + body + [tokenizer.eos_id]
        targets += [False] + [True] * (len(body) + 1)
    return ids, targets


def test_rows_are_consecutive_windows_of_the_stream(tokenizer, write_jsonl):
    records = text_records(40)
    path = write_jsonl(records)
    seq_len, batch = 16, 3
    loader = PackedLoader(path, tokenizer, seq_len, batch, num_epochs=1)
    stream, targets = expected_stream(tokenizer, [r["text"] for r in records])
    rows = [(t, l) for b in loader for t, l in zip(b["tokens"].tolist(), b["labels"].tolist())]
    assert len(rows) == (len(stream) - 1) // seq_len // batch * batch
    for k, (tokens, labels) in enumerate(rows):
        start = k * seq_len
        assert tokens == stream[start : start + seq_len]
        assert labels == [
            stream[start + i + 1] if targets[start + i + 1] else IGNORE_INDEX for i in range(seq_len)
        ]


def test_batches_are_cpu_long_tensors_with_eos_between_samples(tokenizer, write_jsonl):
    loader = PackedLoader(write_jsonl(text_records(30)), tokenizer, seq_len=32, batch_size=2)
    batch = next(loader)
    assert set(batch) == {"tokens", "labels"}
    for value in batch.values():
        assert value.dtype == torch.long and value.device.type == "cpu" and value.shape == (2, 32)
    flat = batch["tokens"].flatten().tolist()
    eos_positions = [i for i, t in enumerate(flat[:-1]) if t == tokenizer.eos_id]
    assert eos_positions and all(flat[i + 1] == tokenizer.bos_id for i in eos_positions if (i + 1) % 32)


def test_instruction_prompts_are_masked(tokenizer, write_jsonl):
    records = [{"prompt": f"add {i}+{i}\n", "response": str(2 * i)} for i in range(20)]
    loader = PackedLoader(write_jsonl(records), tokenizer, seq_len=64, batch_size=1, num_epochs=1, drop_last=False)
    labels = torch.cat([b["labels"].flatten() for b in loader])
    predicted = tokenizer.decode([t for t in labels.tolist() if t != IGNORE_INDEX])
    assert predicted == "".join(str(2 * i) + "<|end_of_text|>" for i in range(20))

    loader = PackedLoader(write_jsonl(records), tokenizer, 64, 1, num_epochs=1, drop_last=False, mask_prompt=False)
    labels = torch.cat([b["labels"].flatten() for b in loader])
    predicted = tokenizer.decode([t for t in labels.tolist() if t != IGNORE_INDEX])
    assert predicted == "".join(f"add {i}+{i}\n{2 * i}<|end_of_text|>" for i in range(20))


def test_samples_longer_than_a_row_continue_in_the_next_row(tokenizer, write_jsonl):
    long_text = "a long sample " * 40
    loader = PackedLoader(write_jsonl([{"text": long_text}]), tokenizer, seq_len=8, batch_size=1, num_epochs=1)
    stream, _ = expected_stream(tokenizer, [long_text])
    rows = [b["tokens"][0].tolist() for b in loader]
    assert sum(rows, []) == stream[: len(rows) * 8]


def test_last_partial_row_is_padded_when_not_dropped(tokenizer, write_jsonl):
    path = write_jsonl([{"text": "short"}])
    assert list(PackedLoader(path, tokenizer, 64, 1, num_epochs=1)) == []
    (batch,) = list(PackedLoader(path, tokenizer, 64, 4, num_epochs=1, drop_last=False))
    stream, _ = expected_stream(tokenizer, ["short"])
    assert batch["tokens"].shape == (1, 64)
    assert batch["tokens"][0, : len(stream)].tolist() == stream
    assert (batch["tokens"][0, len(stream) :] == tokenizer.pad_id).all()
    assert (batch["labels"][0, len(stream) - 1 :] == IGNORE_INDEX).all()


def test_shuffle_buffer_reorders_but_keeps_every_sample(tokenizer, write_jsonl):
    records = [{"text": f"item {i}"} for i in range(50)]
    path = write_jsonl(records)

    def texts(shuffle):
        loader = PackedLoader(path, tokenizer, 32, 1, num_epochs=1, drop_last=False, shuffle_buffer=shuffle, seed=3)
        rows = [b["tokens"][0].tolist() for b in loader]
        text = tokenizer.decode(sum(rows, [])).replace("<|pad|>", "").replace("<|begin_of_text|>", "")
        return [t for t in text.split("<|end_of_text|>") if t]

    ordered, shuffled = texts(0), texts(8)
    assert ordered == [r["text"] for r in records]
    assert shuffled != ordered and sorted(shuffled) == sorted(ordered)


def test_epochs_cycle_and_stop(tokenizer, write_jsonl):
    path = write_jsonl(text_records(10))
    one = sum(1 for _ in PackedLoader(path, tokenizer, 8, 1, num_epochs=1))
    three = sum(1 for _ in PackedLoader(path, tokenizer, 8, 1, num_epochs=3))
    assert one * 3 <= three <= one * 3 + 2
    forever = PackedLoader(path, tokenizer, 8, 1)
    assert len(list(itertools.islice(forever, 4 * one))) == 4 * one


def test_state_is_bounded(tokenizer, write_jsonl):
    loader = PackedLoader(write_jsonl(text_records(200)), tokenizer, 16, 2, shuffle_buffer=5)
    longest = 40
    for batch in itertools.islice(loader, 50):
        state = loader.state_dict()
        assert len(state["pack_ids"]) <= 16 + longest and len(state["shuffle_buffer"]) <= 5


def test_reading_is_lazy(tokenizer, write_jsonl):
    path = write_jsonl(text_records(600) + ["{broken"])
    loader = PackedLoader(path, tokenizer, 16, 2, read_chunk=32)
    next(loader)  # the broken last line is not reached yet
    with pytest.raises(DataError, match=rf"{path}:601: malformed JSON"):
        list(loader)


# -- resume ---------------------------------------------------------------------------------


def make_loader(paths, tokenizer, **kwargs):
    options = dict(seq_len=12, batch_size=3, shuffle_buffer=0, read_chunk=5)
    options.update(kwargs)
    return PackedLoader(paths, tokenizer, **options)


@pytest.mark.parametrize("shuffle_buffer", [0, 7])
@pytest.mark.parametrize("stop_after", [1, 5, 23])
def test_resume_yields_the_uninterrupted_batches(tokenizer, write_jsonl, shuffle_buffer, stop_after):
    paths = [write_jsonl(text_records(9), "a.jsonl"), write_jsonl(text_records(6, start=100), "b.jsonl")]
    uninterrupted = list(itertools.islice(make_loader(paths, tokenizer, shuffle_buffer=shuffle_buffer), stop_after + 12))

    first = make_loader(paths, tokenizer, shuffle_buffer=shuffle_buffer)
    for _ in range(stop_after):
        next(first)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # the state must survive a checkpoint
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    resumed = make_loader(paths, tokenizer, shuffle_buffer=shuffle_buffer, read_chunk=2)  # chunking is not state
    resumed.load_state_dict(state)
    for expected in uninterrupted[stop_after:]:
        got = next(resumed)
        assert torch.equal(got["tokens"], expected["tokens"]) and torch.equal(got["labels"], expected["labels"])


def test_resume_at_the_end_of_finite_epochs(tokenizer, write_jsonl):
    path = write_jsonl(text_records(5))
    loader = make_loader(path, tokenizer, num_epochs=2)
    batches = list(loader)
    resumed = make_loader(path, tokenizer, num_epochs=2)
    resumed.load_state_dict(loader.state_dict())
    assert batches and list(resumed) == []


def test_state_from_other_data_is_rejected(tokenizer, write_jsonl):
    state = make_loader(write_jsonl(text_records(5), "a.jsonl"), tokenizer).state_dict()
    with pytest.raises(ValueError, match=r"loader state is for files \['a.jsonl'\] with seq_len=12, shuffle_buffer=0"):
        make_loader(write_jsonl(text_records(5), "b.jsonl"), tokenizer).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len=13"):
        make_loader(write_jsonl(text_records(5), "a.jsonl"), tokenizer, seq_len=13).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle_buffer=4"):
        make_loader(write_jsonl(text_records(5), "a.jsonl"), tokenizer, shuffle_buffer=4).load_state_dict(state)


def test_missing_tokenizer_and_file_errors(tmp_path, write_jsonl):
    path = write_jsonl(text_records(3))
    with pytest.raises(DataError, match="no tokenizer given"):
        PackedLoader(path, None, 8, 1)
    with pytest.raises(DataError, match=r"missing/tokenizer.json: tokenizer not found"):
        PackedLoader(path, tmp_path / "missing" / "tokenizer.json", 8, 1)
    with pytest.raises(DataError, match=r"absent.jsonl: data file not found"):
        PackedLoader(tmp_path / "absent.jsonl", tmp_path / "missing", 8, 1)
