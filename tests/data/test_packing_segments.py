"""``PackedLoader(document_masking=True)``: per-token segment and position ids of the packed
samples, labels that never cross a sample, and an exact resume of both."""

from __future__ import annotations

import itertools

import torch

from tests.data.test_packing import expected_stream, text_records
from tpu_train.data.packing import IGNORE_INDEX, PackedLoader


def _sample_lengths(tokenizer, records):
    return [len(tokenizer.encode(r["text"])) + 2 for r in records]  # <bos> text <eos>


def test_segments_and_positions_follow_the_samples(tokenizer, write_jsonl):
    records = text_records(40)
    seq_len = 24
    loader = PackedLoader(write_jsonl(records), tokenizer, seq_len, 2, num_epochs=1,
                          document_masking=True)
    stream, _ = expected_stream(tokenizer, [r["text"] for r in records])
    # The sample index and the position within it of every token of the stream.
    sample = torch.repeat_interleave(torch.arange(len(records)),
                                     torch.tensor(_sample_lengths(tokenizer, records)))
    rows = [{k: v[i] for k, v in b.items()} for b in loader for i in range(2)]
    assert len(rows) > 4
    for k, row in enumerate(rows):
        start = k * seq_len
        assert row["tokens"].tolist() == stream[start:start + seq_len]
        owner = sample[start:start + seq_len]
        # Same segment exactly where the same sample, numbered from 1 in each row.
        assert torch.equal(row["segment_ids"][:, None] == row["segment_ids"][None, :],
                           owner[:, None] == owner[None, :])
        assert row["segment_ids"][0] == 1
        # Positions count from 0 at each sample's first token and at the row's first token.
        for i in range(seq_len):
            first = i == 0 or owner[i] != owner[i - 1]
            assert row["position_ids"][i] == (0 if first else row["position_ids"][i - 1] + 1)
        # A sample's last token never has the next sample's first token as its label.
        crosses = owner[1:] != owner[:-1]
        assert (row["labels"][:-1][crosses] == IGNORE_INDEX).all()


def test_without_document_masking_the_batch_is_unchanged(tokenizer, write_jsonl):
    path = write_jsonl(text_records(30))
    plain = next(PackedLoader(path, tokenizer, 32, 2))
    masked = next(PackedLoader(path, tokenizer, 32, 2, document_masking=True))
    assert set(plain) == {"tokens", "labels"}
    assert set(masked) == {"tokens", "labels", "segment_ids", "position_ids"}
    assert all(torch.equal(plain[k], masked[k]) for k in plain)


def test_padding_is_a_segment_of_its_own(tokenizer, write_jsonl):
    (batch,) = PackedLoader(write_jsonl([{"text": "short"}, {"text": "also short"}]), tokenizer,
                            64, 1, num_epochs=1, drop_last=False, document_masking=True)
    used = sum(_sample_lengths(tokenizer, [{"text": "short"}, {"text": "also short"}]))
    assert batch["segment_ids"][0, :used].unique().tolist() == [1, 2]
    assert (batch["segment_ids"][0, used:] == 3).all()
    assert batch["position_ids"][0, used] == 0


def test_resume_gives_the_same_segments(tokenizer, write_jsonl):
    path = write_jsonl(text_records(80))
    loader = PackedLoader(path, tokenizer, 16, 2, shuffle_buffer=4, document_masking=True)
    list(itertools.islice(loader, 3))
    state = loader.state_dict()
    expected = list(itertools.islice(loader, 4))
    resumed = PackedLoader(path, tokenizer, 16, 2, shuffle_buffer=4, document_masking=True)
    resumed.load_state_dict(state)
    # A state saved before sample starts were kept: they are read from the <bos> tokens.
    older = PackedLoader(path, tokenizer, 16, 2, shuffle_buffer=4, document_masking=True)
    older.load_state_dict({k: v for k, v in state.items() if k != "pack_starts"})
    for loader_ in (resumed, older):
        for got, want in zip(itertools.islice(loader_, 4), expected):
            assert all(torch.equal(got[k], want[k]) for k in want)
