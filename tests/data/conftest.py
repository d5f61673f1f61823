"""Shared fixtures for the data tests: the bundled tokenizer and small data files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tpu_train.data.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture
def write_jsonl(tmp_path):
    """Write records (dicts, or raw strings written verbatim) as lines of a file in tmp_path."""

    def write(records, name: str = "data.jsonl") -> Path:
        path = tmp_path / name
        with path.open("w", encoding="utf-8") as f:
            for record in records:
                f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
        return path

    return write
