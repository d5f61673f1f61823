"""RandomTokenLoader, the source of ``data=synthetic_tokens``: seeded, in range, shifted
labels, resumable, bad arguments named."""

from __future__ import annotations

import pytest
import torch

from tpu_train.data import RandomTokenLoader


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def test_batches_have_the_shape_range_and_shifted_labels():
    batch = next(RandomTokenLoader(vocab_size=50, seq_len=16, batch_size=3, seed=1))
    assert set(batch) == {"tokens", "labels"}
    for key in ("tokens", "labels"):
        assert batch[key].shape == (3, 16) and batch[key].dtype == torch.int64
        assert int(batch[key].min()) >= 0 and int(batch[key].max()) < 50
    # Each row is 17 draws: the labels are the tokens one position on, every position a target.
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])


def test_ids_cover_the_vocabulary_uniformly():
    loader = RandomTokenLoader(vocab_size=8, seq_len=512, batch_size=8, seed=0)
    counts = torch.bincount(next(loader)["tokens"].flatten(), minlength=8).double()
    # 4096 draws over 8 ids: 512 each expected, standard deviation sqrt(4096 * 1/8 * 7/8) = 21.2.
    assert counts.numel() == 8 and float((counts - 512).abs().max()) < 5 * 21.2


def test_same_seed_same_stream_other_seed_other_stream():
    a = _take(RandomTokenLoader(1000, 8, 2, seed=3), 3)
    b = _take(RandomTokenLoader(1000, 8, 2, seed=3), 3)
    c = _take(RandomTokenLoader(1000, 8, 2, seed=4), 3)
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))
    assert not torch.equal(a[0]["tokens"], c[0]["tokens"])
    assert not torch.equal(a[0]["tokens"], a[1]["tokens"])


def test_resumes_exactly_from_its_state():
    loader = RandomTokenLoader(1000, 8, 2, seed=5)
    _take(loader, 2)
    state = loader.state_dict()
    expected = _take(loader, 2)
    resumed = RandomTokenLoader(1000, 8, 2, seed=5)
    resumed.load_state_dict(state)
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(expected, _take(resumed, 2)))


def test_state_of_other_settings_or_files_is_refused():
    state = RandomTokenLoader(1000, 8, 2, seed=5).state_dict()
    with pytest.raises(ValueError, match="drawn with"):
        RandomTokenLoader(1000, 16, 2, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="not of random tokens"):
        RandomTokenLoader(1000, 8, 2, seed=5).load_state_dict({"version": 3, "files": []})


@pytest.mark.parametrize("kwargs,name", [
    ({"vocab_size": 0}, "vocab_size"), ({"seq_len": 0}, "seq_len"),
    ({"batch_size": -1}, "batch_size"), ({"seed": -1}, "seed"), ({"vocab_size": 2.5}, "vocab_size"),
])
def test_bad_arguments_are_named(kwargs, name):
    settings = {"vocab_size": 10, "seq_len": 4, "batch_size": 2, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=f"^{name} must be an int"):
        RandomTokenLoader(**settings)
