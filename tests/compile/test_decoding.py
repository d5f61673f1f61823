"""Compiled decoding (tpu_train.compile.decoding) against transformers' generate and eager
decoding on the same device: greedy tokens, end tokens, seeded nucleus sampling, buckets and
recompilation."""

from __future__ import annotations

import pytest
import torch

import tpu_train
from tests.models.hf_reference import hf_llama, random_tokens
from tpu_train.compile.decoding import Buckets, CompiledDecoder, choose_buckets
from tpu_train.models import from_pretrained, generate
from tpu_train.models.generation import StaticCacheDecoding

DEVICE = tpu_train.device(0)
NEW = 12
# Several lengths in one batch: rows are left-padded to the prompt bucket (32 here).
LENGTHS = (3, 9, 17, 6)


@pytest.fixture(autouse=True)
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers reference, the same weights as our Llama on the tpu device and on the
    CPU, a function saving a reference of another seed)."""
    def save(seed):
        hf_model = hf_llama("llama3_1", seed=seed)
        directory = tmp_path_factory.mktemp(f"seed{seed}")
        hf_model.save_pretrained(directory, safe_serialization=True)
        return hf_model, directory

    hf_model, directory = save(11)
    return hf_model, from_pretrained(directory).to(DEVICE), from_pretrained(directory), save


@pytest.fixture(scope="module")
def decoder(models):
    return CompiledDecoder(models[1], StaticCacheDecoding())


def prompts(seed: int = 3) -> list[list[int]]:
    return [random_tokens(1, n, seed=seed + i)[0].tolist() for i, n in enumerate(LENGTHS)]


def hf_greedy(hf_model, rows: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy continuation of left-padded rows (its own position ids)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


def test_buckets_are_powers_of_two_that_fit():
    assert choose_buckets(3, 17, 12, 256) == Buckets(4, 32, 16)
    assert choose_buckets(32, 5, 8, 256) == Buckets(32, 16, 16)
    assert choose_buckets(5, 100, 100, 256) == Buckets(8, 128, 128)
    # Rounding would overflow max_seq_len 256: the buckets shrink to fit.
    assert choose_buckets(1, 130, 100, 256) == Buckets(1, 156, 100)
    assert choose_buckets(1, 100, 140, 256) == Buckets(1, 116, 140)
    with pytest.raises(ValueError, match="max_seq_len 256"):
        choose_buckets(1, 200, 57, 256)


def test_static_cache_step_matches_the_forward_on_cpu(models):
    """The model layer's half, eagerly on the CPU: left-padded rows in a static cache give
    the logits of each row's own forward, after the prompt and after one more token."""
    model = models[2]
    decoding, rows = StaticCacheDecoding(), prompts()
    width, length = 20, 24
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    pad = torch.tensor([width - len(r) for r in rows])
    caches = [torch.zeros(s, dtype=d) for s, d in decoding.cache_shapes(model, len(rows), length)]
    logits, caches = decoding.step(model, tokens, torch.tensor(0), pad, caches)
    following = logits.argmax(-1)
    logits_2, _ = decoding.step(model, following[:, None], torch.tensor(width), pad, caches)
    for i, row in enumerate(rows):
        torch.testing.assert_close(logits[i], model(torch.tensor([row]))[0, -1],
                                   rtol=1e-4, atol=1e-4)
        extended = torch.tensor([row + [int(following[i])]])
        torch.testing.assert_close(logits_2[i], model(extended)[0, -1], rtol=1e-4, atol=1e-4)


def test_greedy_matches_transformers_and_eager_decoding(models, decoder):
    hf_model, model, _, _ = models
    rows = prompts()
    ours = decoder.generate(rows, NEW)
    assert ours.shape == (len(rows), NEW)
    assert ours.tolist() == hf_greedy(hf_model, rows, NEW)
    # Eager greedy decoding on the same device (op by op, so one short row: it is slow).
    eager = generate(model, torch.tensor([rows[1]]), 6)[0, len(rows[1]):]
    assert eager.tolist() == ours[1, :6].tolist()
    assert len(decoder.compilations) == 1


def test_end_tokens_stop_rows_and_the_loop(models, decoder):
    hf_model, model, _, _ = models
    rows = prompts()
    free = hf_greedy(hf_model, rows, NEW)
    # Each row's 4th greedy token is an end token: every row ends by its 4th step.
    eos = list(dict.fromkeys(row[3] for row in free))

    def ended(row):
        end = next(i for i, t in enumerate(row) if t in eos) + 1
        return row[:end] + [eos[0]] * (len(row) - end), end  # finished rows repeat eos[0]

    expected = [ended(row) for row in free]
    length = max(end for _, end in expected)  # the loop stops once every row has ended
    assert length < NEW
    stopped = decoder.generate(rows, NEW, eos_token_id=eos)
    assert stopped.tolist() == [tokens[:length] for tokens, _ in expected]
    # Fixed steps (no early stop): the same tokens, every row padded to NEW.
    fixed = CompiledDecoder(model, StaticCacheDecoding(), early_stop=False)
    assert fixed.generate(rows, NEW, eos_token_id=eos).tolist() == [t for t, _ in expected]


def nucleus_ranks(hf_model, row: list[int], sampled: list[int], temperature: float):
    """For each sampled token, the probability mass ranked above it (its ``mass_before``)
    under transformers' model given the tokens before it."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([row + sampled])).logits[0, len(row) - 1:-1]
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    chosen = probs.gather(1, torch.tensor(sampled)[:, None])[:, 0]
    return [float(probs[i][probs[i] > chosen[i]].sum()) for i in range(len(sampled))]


def test_sampling_is_seeded_and_stays_in_the_nucleus(models, decoder):
    hf_model, _, _, _ = models
    rows, top_p = prompts(seed=20), 0.6

    def sample(seed):
        return decoder.generate(rows, NEW, temperature=1.0, top_p=top_p, seed=seed).tolist()

    first = sample(0)
    assert sample(0) == first
    assert sample(1) != first
    assert first != decoder.generate(rows, NEW).tolist()  # not greedy in disguise
    for row, tokens in zip(rows, first):
        # A token is in the nucleus when the mass ranked above it is below top_p (1e-4:
        # float32 differences between the two implementations at the boundary).
        assert max(nucleus_ranks(hf_model, row, tokens, 1.0)) < top_p + 1e-4


def test_sampled_first_tokens_follow_the_distribution(models, decoder):
    hf_model, _, _, _ = models
    row, draws, temperature = prompts(seed=40)[1], 256, 1.5
    sampled = decoder.generate([row] * draws, 1, temperature=temperature, seed=7)[:, 0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([row])).logits[0, -1].double()
    expected = torch.softmax(logits / temperature, dim=-1)
    frequencies = torch.bincount(sampled, minlength=expected.numel()).double() / draws
    # Total variation between the empirical and true distribution: its mean is about
    # sum_k sqrt(p_k (1 - p_k) / (2 pi n)) (0.11 here at most); 0.25 is far out in the tail.
    assert 0.5 * float((frequencies - expected).abs().sum()) < 0.25
    assert len(set(sampled.tolist())) > 3


def test_new_weights_reuse_the_program(models, decoder):
    hf_model, model, _, save = models
    rows = prompts(seed=50)
    decoder.generate(rows, NEW)
    compiled = len(decoder.compilations)
    other_hf, directory = save(12)
    original = {k: v.to("cpu") for k, v in model.state_dict().items()}
    try:
        model.load_state_dict(from_pretrained(directory).state_dict())
        assert decoder.generate(rows, NEW).tolist() == hf_greedy(other_hf, rows, NEW)
    finally:
        model.load_state_dict(original)
    assert len(decoder.compilations) == compiled
    # A batch of another bucket is a new program, with its cause named.
    decoder.generate(rows[:1] * 5, NEW)
    assert len(decoder.compilations) == compiled + 1
    assert "batch bucket changed from 4 to 8" in decoder.compilations[-1].cause


def test_bad_requests_are_errors(decoder):
    with pytest.raises(ValueError, match="max_seq_len 256"):
        decoder.generate([[1] * 200], 100)
    with pytest.raises(ValueError, match="non-empty"):
        decoder.generate([[]], 4)
    with pytest.raises(ValueError, match="top_p"):
        decoder.generate([[1, 2]], 4, temperature=1.0, top_p=0.0)
    assert decoder.generate([[1, 2]], 0).shape == (1, 0)
