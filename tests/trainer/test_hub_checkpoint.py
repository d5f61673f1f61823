"""``model.checkpoint=ORG/NAME[@revision]``: a Hugging Face Hub model through ``huggingface_hub``,
here from a cache filled beforehand and ``HF_HUB_OFFLINE=1`` (this machine reaches no Hub).
Failures of the look-up are in tests/bad_input/test_hub_models.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.trainer.cli_helpers import TINY, one_thread, read_metrics, run_in_process  # noqa: F401
from tests.trainer.hf_checkpoint import LINES, custom_llama  # noqa: F401 (a fixture)
from tests.trainer.hub_cache import COMMIT, fill_hub_cache

pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")

REPO = "tiny-org/custom-llama"


@pytest.fixture
def offline_cache(custom_llama, tmp_path, monkeypatch) -> Path:
    """The custom Llama as the Hub snapshot of ``REPO`` in a cache of its own, offline."""
    cache = tmp_path / "hub"
    snapshot = fill_hub_cache(cache, REPO, custom_llama)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def _train_file(directory: Path) -> Path:
    path = directory / "train.jsonl"
    records = [{"prompt": line, "response": line[::-1]} for line in LINES] * 3
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_filled_cache_is_one_huggingface_hub_recognises(offline_cache):
    repos = huggingface_hub.scan_cache_dir(offline_cache.parents[2]).repos
    assert [(r.repo_id, [(rev.commit_hash, sorted(rev.refs)) for rev in r.revisions])
            for r in repos] == [(REPO, [(COMMIT, ["main"])])]


def test_finetunes_a_hub_model_by_name_offline(offline_cache, custom_llama, tmp_path, one_thread):
    data = _train_file(tmp_path)
    common = ["data=jsonl", f"data.path={data}", *TINY, "trainer.max_steps=2"]
    code, out, err = run_in_process(f"model.checkpoint={REPO}", *common, f"run.dir={tmp_path / 'hub'}")
    assert code == 0, err
    assert f"note: model.checkpoint={REPO}: the Hugging Face Hub snapshot in {offline_cache}" in out
    assert "step 2/2" in out and re.search(rf"started from: +{re.escape(str(offline_cache))}\n", out)
    # The same model and tokenizer as the directory the cache was filled from: the same losses.
    code, _, err = run_in_process(f"model.checkpoint={custom_llama}", *common,
                                  f"run.dir={tmp_path / 'local'}")
    assert code == 0, err
    hub, local = read_metrics(tmp_path / "hub"), read_metrics(tmp_path / "local")
    assert [hub[s]["train/loss"] for s in (1, 2)] == [local[s]["train/loss"] for s in (1, 2)]


def _resolve(value: str):
    from tpu_train.trainer.validation import resolve_model_checkpoint

    cfg = OmegaConf.create({"model": {"checkpoint": value}})
    return resolve_model_checkpoint(cfg), cfg.model.checkpoint


def test_a_revision_after_the_at_sign_picks_that_snapshot(offline_cache):
    note, resolved = _resolve(f"{REPO}@{COMMIT}")
    assert Path(resolved) == offline_cache and f"model.checkpoint={REPO}@{COMMIT}:" in note
    assert _resolve(f"{REPO}@main")[1] == str(offline_cache)


def test_a_local_directory_of_that_name_wins(offline_cache, custom_llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(custom_llama, tmp_path / REPO)
    assert _resolve(REPO) == (None, REPO)


def test_only_the_files_a_model_is_built_from_are_asked_for():
    from tpu_train.models.hub import MODEL_FILES

    fnmatch = pytest.importorskip("fnmatch").fnmatch
    wanted = ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
              "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja"]
    unwanted = ["pytorch_model.bin", "original/consolidated.00.pth", "onnx/model.onnx", "README.md"]
    assert all(any(fnmatch(name, p) for p in MODEL_FILES) for name in wanted)
    assert not any(fnmatch(name, p) for name in unwanted for p in MODEL_FILES)


@pytest.mark.parametrize("value, expected", [
    ("meta-llama/Llama-3.2-1B", ("meta-llama/Llama-3.2-1B", None)),
    ("meta-llama/Llama-3.2-1B@v1.0", ("meta-llama/Llama-3.2-1B", "v1.0")),
    ("runs/ft", ("runs/ft", None)),  # a relative path that does not exist reads as a Hub id
    ("./runs/ft", None), ("/ckpt/Llama", None), ("runs/ft/hf", None), ("../x/y", None),
    ("name", None),
])
def test_what_reads_as_a_hub_model_id(value, expected):
    from tpu_train.models.hub import parse_model_id

    parsed = parse_model_id(value)
    assert (None if parsed is None else (parsed.repo_id, parsed.revision)) == expected
