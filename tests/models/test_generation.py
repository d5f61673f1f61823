"""Generation: greedy parity with `transformers`, sampling statistics, eos handling."""

import pytest
import torch

from tpu_train.models import from_pretrained, generate, sample_next_token

from .hf_reference import hf_llama, random_tokens


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory):
    hf_model = hf_llama("llama3_1", seed=11)
    directory = tmp_path_factory.mktemp("greedy")
    hf_model.save_pretrained(directory, safe_serialization=True)
    return hf_model, from_pretrained(directory)


def test_greedy_matches_transformers_generate(model_pair):
    hf_model, model = model_pair
    prompt = random_tokens(2, 7, seed=5)
    new_tokens = 24
    expected = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
    ours = generate(model, prompt, new_tokens)
    assert ours.shape == (2, 7 + new_tokens)
    assert torch.equal(ours, expected)


def test_generation_stops_at_eos_and_pads_finished_rows(model_pair):
    _, model = model_pair
    prompt = random_tokens(2, 5, seed=6)
    free_run = generate(model, prompt, 12)[:, 5:].tolist()
    eos = free_run[0][3]  # the 4th greedy token of row 0 becomes the end marker

    def expected(row):
        """Tokens up to and including the first eos, then eos padding; and where it ended."""
        if eos not in row:
            return row, len(row)
        end = row.index(eos) + 1
        return row[:end] + [eos] * (len(row) - end), end

    rows = [expected(row) for row in free_run]
    length = max(end for _, end in rows)  # stops once every row has finished
    stopped = generate(model, prompt, 12, eos_token_id=[eos, 10**6])
    assert stopped.shape == (2, 5 + length)
    for generated, (tokens, _) in zip(stopped[:, 5:].tolist(), rows):
        assert generated == tokens[:length]
    single = generate(model, prompt[:1], 12, eos_token_id=eos)
    assert single[0, 5:].tolist() == free_run[0][:rows[0][1]]


def test_sampling_is_reproducible_per_generator(model_pair):
    _, model = model_pair
    prompt = random_tokens(2, 4, seed=7)

    def run(seed):
        return generate(model, prompt, 16, temperature=1.0, top_p=0.9,
                        generator=torch.Generator().manual_seed(seed))

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))


def test_tiny_nucleus_is_greedy(model_pair):
    _, model = model_pair
    prompt = random_tokens(2, 4, seed=8)
    sampled = generate(model, prompt, 10, temperature=0.7, top_p=1e-6,
                       generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, generate(model, prompt, 10))


def test_sampled_frequencies_follow_temperature_and_nucleus():
    draws = 40_000
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(draws, 1)
    generator = torch.Generator().manual_seed(0)

    def frequencies(**kwargs):
        tokens = sample_next_token(logits, generator=generator, **kwargs)
        return torch.bincount(tokens, minlength=4).double() / draws

    # Sampling error, not rounding: a frequency's standard error sqrt(p(1-p)/draws) is at most
    # 0.5 / sqrt(draws) (0.0025 here); allow five of them.
    atol = 5 * 0.5 / draws ** 0.5
    plain = frequencies(temperature=1.0)
    torch.testing.assert_close(plain, torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.double),
                               rtol=0, atol=atol)
    hot = frequencies(temperature=2.0)
    hot_expected = torch.softmax(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])) / 2.0, dim=-1)
    torch.testing.assert_close(hot, hot_expected.double(), rtol=0, atol=atol)
    nucleus = frequencies(temperature=1.0, top_p=0.7)
    assert nucleus[2] == 0 and nucleus[3] == 0
    torch.testing.assert_close(nucleus, torch.tensor([0.625, 0.375, 0, 0], dtype=torch.double),
                               rtol=0, atol=atol)


def test_generate_rejects_bad_requests(model_pair):
    _, model = model_pair
    with pytest.raises(ValueError, match="max_seq_len 256"):
        generate(model, random_tokens(1, 200), 100)
    with pytest.raises(ValueError, match=r"\[batch, prompt_len\]"):
        generate(model, torch.tensor([1, 2, 3]), 4)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, random_tokens(1, 3), 4, temperature=1.0, top_p=0.0)
