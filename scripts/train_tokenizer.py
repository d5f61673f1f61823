"""Rebuild the bundled corpus and train the bundled 512-token byte-level BPE tokenizer.

Exact command (from the repository root; both steps are deterministic)::

    python scripts/train_tokenizer.py

It rewrites ``tpu_train/assets/corpus/{pretrain,tasks_train,tasks_heldout}.jsonl`` (from
``handwritten.txt`` and the generators in ``tpu_train.data``) and
``tpu_train/assets/tokenizer/tokenizer.json``. ``--skip-corpus`` trains on the corpus as it is.

The vocabulary is exactly 512 ids: 6 special tokens, the 256 byte symbols and 250 merges.
Pre-tokenization splits digits into single characters (so arithmetic sees one token per
digit), keeps runs of newlines apart from words, and lets a word or punctuation run take one
leading space.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tpu_train.data.corpus import build_corpus, default_corpus_dir, iter_corpus_texts  # noqa: E402
from tpu_train.data.tokenizer import DEFAULT_SPECIAL_TOKENS, default_tokenizer_path  # noqa: E402

VOCAB_SIZE = 512
SPLIT_PATTERN = r"'(?:s|t|re|ve|m|ll|d)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s*[\r\n]+|\s+(?!\S)|\s+"


def build_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE with the project's pre-tokenization."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train(out_path: Path, corpus_dir: Path) -> Tokenizer:
    tokenizer = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(DEFAULT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_corpus_texts(corpus_dir), trainer=trainer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise SystemExit(f"trained vocabulary has {size} ids, expected exactly {VOCAB_SIZE}; the corpus is too small")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_path), pretty=True)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-corpus", action="store_true", help="train on the corpus as it is")
    parser.add_argument("--out", type=Path, default=default_tokenizer_path(), help="tokenizer.json to write")
    args = parser.parse_args()
    if not args.skip_corpus:
        for name, path in build_corpus().items():
            print(f"wrote {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}")
    train(args.out, default_corpus_dir())
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()[:16]
    print(f"wrote {args.out} ({VOCAB_SIZE} tokens, sha256 {digest})")


if __name__ == "__main__":
    main()
