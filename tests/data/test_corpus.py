from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path


from tpu_train.data.corpus import HANDWRITTEN, PRETRAIN, TASKS_HELDOUT, TASKS_TRAIN, build_corpus, default_corpus_dir
from tpu_train.data.tokenizer import DEFAULT_SPECIAL_TOKENS, default_tokenizer_path, load_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_tokenizer.py"


def test_bundled_corpus_is_small_and_reproducible(tmp_path):
    corpus = default_corpus_dir()
    total = sum(p.stat().st_size for p in corpus.iterdir())
    assert total < 5 * 1024 * 1024  # the fine-tuning examples are 3.4 MB of it
    written = build_corpus(tmp_path)
    assert set(written) == {PRETRAIN, TASKS_TRAIN, TASKS_HELDOUT}
    for name, path in written.items():
        assert path.read_bytes() == (corpus / name).read_bytes(), f"{name} is stale: rerun scripts/train_tokenizer.py"
    assert (corpus / HANDWRITTEN).is_file()


def test_bundled_tokenizer_is_reproducible(tmp_path):
    spec = importlib.util.spec_from_file_location("train_tokenizer", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "tokenizer.json"
    script.train(out, default_corpus_dir())
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(out) == digest(default_tokenizer_path()), "tokenizer.json is stale: rerun scripts/train_tokenizer.py"
    retrained = load_tokenizer(out)
    assert retrained.vocab_size == 512
    assert [retrained.special_ids[t] for t in DEFAULT_SPECIAL_TOKENS] == list(range(6))
