from __future__ import annotations

import pytest
import sentencepiece
import tokenizers

from tpu_train.data.errors import DataError
from tpu_train.data.tokenizer import (
    DEFAULT_SPECIAL_TOKENS,
    HFTokenizer,
    SentencePieceTokenizer,
    default_tokenizer_path,
    load_tokenizer,
)

TEXTS = [
    "The old farmer carried a basket of apples.",
    "add 123+45\n168",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines",
    "unicode: héllo wörld, 日本語, emoji 😀",
    "",
]


def test_bundled_tokenizer_has_512_ids_and_llama3_specials(tokenizer):
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.vocab_size == 512
    assert set(DEFAULT_SPECIAL_TOKENS) <= set(tokenizer.special_ids)
    assert tokenizer.bos_id == tokenizer.special_ids["<|begin_of_text|>"]
    assert tokenizer.eos_id == tokenizer.special_ids["<|end_of_text|>"]
    assert tokenizer.pad_id == tokenizer.special_ids["<|pad|>"]


@pytest.mark.parametrize("text", TEXTS)
def test_hf_round_trip_and_agreement_with_library(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    reference = tokenizers.Tokenizer.from_file(str(default_tokenizer_path()))
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert max(ids, default=0) < tokenizer.vocab_size


def test_bos_eos_flags_and_batch(tokenizer):
    body = tokenizer.encode("hello there")
    assert tokenizer.encode("hello there", bos=True, eos=True) == [tokenizer.bos_id] + body + [tokenizer.eos_id]
    assert tokenizer.encode_batch(["hello there", "x"], eos=True) == [body + [tokenizer.eos_id], tokenizer.encode("x") + [tokenizer.eos_id]]


def test_digits_are_single_tokens(tokenizer):
    ids = tokenizer.encode("9081726354")
    assert len(ids) == 10


def test_special_token_text_in_data_is_not_a_control_token(tokenizer):
    ids = tokenizer.encode("say <|eot_id|> now")
    assert tokenizer.special_ids["<|eot_id|>"] not in ids
    assert tokenizer.decode(ids) == "say <|eot_id|> now"


def test_decode_can_skip_specials(tokenizer):
    ids = tokenizer.encode("hi", bos=True, eos=True)
    assert tokenizer.decode(ids) == "<|begin_of_text|>hi<|end_of_text|>"
    assert tokenizer.decode(ids, skip_special=True) == "hi"


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    """A tiny SentencePiece BPE model trained here, with the Llama 3 chat markers as user symbols."""
    directory = tmp_path_factory.mktemp("spm")
    sentences = [t for t in TEXTS if t] * 20 + [f"sentence number {i} about apples and pears" for i in range(200)]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_prefix=str(directory / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        user_defined_symbols=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"],
        minloglevel=2,
    )
    return directory / "tokenizer.model"


def test_sentencepiece_round_trip_and_ids(sentencepiece_model):
    tok = load_tokenizer(sentencepiece_model)
    assert isinstance(tok, SentencePieceTokenizer)
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    assert tok.vocab_size == reference.vocab_size()
    assert (tok.bos_id, tok.eos_id) == (reference.bos_id(), reference.eos_id())
    for text in ["sentence number 7 about apples", "héllo wörld 😀"]:
        ids = tok.encode(text, bos=True, eos=True)
        assert ids == [reference.bos_id()] + reference.encode(text) + [reference.eos_id()]
        assert tok.decode(ids, skip_special=True) == text
        assert tok.decode(ids) == "<s>" + text + "</s>"
    assert "<|eot_id|>" in tok.special_ids


def test_load_tokenizer_picks_by_directory_content(tmp_path, sentencepiece_model):
    (tmp_path / "tokenizer.model").write_bytes(sentencepiece_model.read_bytes())
    assert isinstance(load_tokenizer(tmp_path), SentencePieceTokenizer)
    (tmp_path / "tokenizer.json").write_bytes(default_tokenizer_path().read_bytes())
    assert isinstance(load_tokenizer(tmp_path), HFTokenizer)  # tokenizer.json wins


def test_missing_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match=r"nope/tokenizer.json.*tokenizer not found"):
        load_tokenizer(tmp_path / "nope" / "tokenizer.json")
    with pytest.raises(DataError, match=rf"{tmp_path}.*expected tokenizer.json .* or tokenizer.model"):
        load_tokenizer(tmp_path)
    bad = tmp_path / "vocab.txt"
    bad.write_text("x")
    with pytest.raises(DataError, match=r"vocab.txt.*unrecognised tokenizer file type"):
        load_tokenizer(bad)
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    with pytest.raises(DataError, match=r"tokenizer.json.*cannot read tokenizer file"):
        load_tokenizer(broken)
