"""Weighted mixtures of data files: proportions, determinism, per-file cycling, exact resume."""

from __future__ import annotations

import io
import itertools
import math

import pytest
import torch

from tpu_train.data.packing import PackedLoader
from tpu_train.data.sources import DataFiles
from tpu_train.data.streams import MixtureStream

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def tagged(tag, n):
    return [{"text": f"{tag} {i}"} for i in range(n)]


def drawn(stream, tokenizer, n):
    """The texts of the next ``n`` samples (decoded: the oracle is the records written)."""
    return [tokenizer.decode(list(stream.take().ids), skip_special=True) for _ in range(n)]


def mixture(paths, weights, tokenizer, seed=0, **kwargs):
    return MixtureStream(DataFiles.of(paths, kwargs.pop("column_map", None)), weights, seed, tokenizer, "auto", True, 8)


def test_proportions_follow_the_weights(tokenizer, write_jsonl):
    a, b, c = (write_jsonl(tagged(tag, n), f"{tag}.jsonl") for tag, n in (("alpha", 50), ("beta", 7), ("gamma", 20)))
    weights = [0.5, 0.3, 0.2]
    n = 3000
    texts = drawn(mixture([a, b, c], weights, tokenizer), tokenizer, n)
    for tag, weight in zip(("alpha", "beta", "gamma"), weights):
        share = sum(t.startswith(tag) for t in texts) / n
        # Binomial standard deviation: 4.5 of them fail a correct sampler about once in 10^5.
        assert abs(share - weight) < 4.5 * math.sqrt(weight * (1 - weight) / n), (tag, share)


def test_each_file_cycles_on_its_own_and_the_seed_decides(tokenizer, write_jsonl):
    a, b = write_jsonl(tagged("alpha", 40), "a.jsonl"), write_jsonl(tagged("beta", 3), "b.jsonl")
    texts = drawn(mixture([a, b], [1, 1], tokenizer, seed=3), tokenizer, 60)
    # Each file's samples keep its order and restart after its last record, independently.
    assert [t for t in texts if t.startswith("beta")] == [f"beta {i % 3}" for i in range(sum(t.startswith("beta") for t in texts))]
    assert [t for t in texts if t.startswith("alpha")] == [f"alpha {i}" for i in range(sum(t.startswith("alpha") for t in texts))]
    assert drawn(mixture([a, b], [1, 1], tokenizer, seed=3), tokenizer, 60) == texts
    assert drawn(mixture([a, b], [1, 1], tokenizer, seed=4), tokenizer, 60) != texts


@pytest.mark.parametrize("shuffle_buffer", [0, 5])
@pytest.mark.parametrize("stop_after", [1, 4, 9])
def test_resume_yields_the_uninterrupted_batches(tmp_path, tokenizer, write_jsonl, shuffle_buffer, stop_after):
    jsonl = write_jsonl([{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(23)], "a.jsonl")
    table = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": f"q {i} " + "x " * (i % 5), "a": f"a {i}"} for i in range(11)]), table, row_group_size=4)
    options = dict(seq_len=12, batch_size=3, shuffle_buffer=shuffle_buffer, seed=7, read_chunk=5, weights=[0.6, 0.4], column_map={"prompt": "q", "response": "a"})

    def loader():
        return PackedLoader([jsonl, table], tokenizer, **options)

    uninterrupted = [b["tokens"].tolist() + b["labels"].tolist() for b in itertools.islice(loader(), stop_after + 6)]
    first = loader()
    assert [b["tokens"].tolist() + b["labels"].tolist() for b in itertools.islice(first, stop_after)] == uninterrupted[:stop_after]
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # the state must survive a checkpoint
    buffer.seek(0)
    resumed = loader()
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    assert [b["tokens"].tolist() + b["labels"].tolist() for b in itertools.islice(resumed, 6)] == uninterrupted[stop_after:]


def test_state_must_match_the_mixture(tokenizer, write_jsonl):
    a, b = write_jsonl(tagged("alpha", 9), "a.jsonl"), write_jsonl(tagged("beta", 9), "b.jsonl")
    mixed = PackedLoader([a, b], tokenizer, 8, 2, weights=[1, 2])
    next(mixed)
    in_order = PackedLoader([a, b], tokenizer, 8, 2)
    with pytest.raises(ValueError, match=r"weights=\[1.0, 2.0\], but this loader .* weights=None"):
        in_order.load_state_dict(mixed.state_dict())
    with pytest.raises(ValueError, match=r"weights=\[2.0, 1.0\]"):
        PackedLoader([a, b], tokenizer, 8, 2, weights=[2, 1]).load_state_dict(mixed.state_dict())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(weights=[1.0]), "1 weights for 2 data files; give one weight per file"),
        (dict(weights=[1.0, -0.5]), "weight 1 is -0.5; weights must be positive"),
        (dict(weights=[1.0, 0.0]), "weight 1 is 0.0"),
        (dict(weights=[1.0, 1.0], num_epochs=1), "num_epochs must be None"),
    ],
)
def test_bad_weights_are_rejected(tokenizer, write_jsonl, kwargs, message):
    paths = [write_jsonl(tagged("alpha", 3), "a.jsonl"), write_jsonl(tagged("beta", 3), "b.jsonl")]
    with pytest.raises(ValueError, match=message):
        PackedLoader(paths, tokenizer, 8, 2, **kwargs)
