"""Bad Hub model names, prompt/response templates and held-out splits: each is one line on
stderr, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest

from tests.bad_input.conftest import assert_one_line_error, run_against
from tests.trainer.cli_helpers import snapshot
from tests.trainer.hub_cache import fill_hub_cache

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = {
    "unknown_template": (["data.template=alpaca"], "valid templates: auto, chat, default, none"),
    "holdout_too_large": (["data.holdout=0.9"], "data.holdout must be in [0, 0.5]"),
    "holdout_negative": (["data.holdout=-0.1"], "data.holdout must be in [0, 0.5]"),
    "holdout_not_a_number": (["data.holdout=some"], "data.holdout"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bad_data_option(name, existing_run):
    overrides, expected = CONFIGS[name]
    before = snapshot(existing_run)
    code, out, err = run_against(existing_run, *overrides)
    assert_one_line_error(code, out, err, expected)
    assert snapshot(existing_run) == before


def _records(count: int) -> str:
    return "".join(json.dumps({"prompt": f"say {i}", "response": str(i)}) + "\n" for i in range(count))


def test_a_file_with_no_training_record_left(existing_run, tmp_path):
    """A large held-out fraction can take a small file's only record: a stream of that file
    would have nothing to train on (and a mixture would wait for it forever)."""
    from pathlib import Path

    from tpu_train.data.sources import Holdout
    from tpu_train.trainer.builders import HOLDOUT_SEED

    held = Holdout(0.5, held_out=True, seed=HOLDOUT_SEED)
    name = next(f"small{i}.jsonl" for i in range(100) if held.keeps(Path(f"small{i}.jsonl"), 1))
    (tmp_path / "big.jsonl").write_text(_records(200))
    (tmp_path / name).write_text(_records(1))
    before = snapshot(existing_run)
    code, out, err = run_against(existing_run, f"data.path=[{tmp_path / 'big.jsonl'},{tmp_path / name}]",
                                 "data.holdout=0.5")
    assert_one_line_error(code, out, err, f"{name}: no record falls on the training side of a 50% held-out split")
    assert snapshot(existing_run) == before


@pytest.fixture
def empty_offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def test_hub_model_offline_and_not_cached(existing_run, empty_offline_cache):
    before = snapshot(existing_run)
    code, out, err = run_against(existing_run, "model.checkpoint=nobody/no-model")
    assert_one_line_error(code, out, err, "model.checkpoint=nobody/no-model is not in the Hugging "
                                          "Face cache")
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in err
    assert snapshot(existing_run) == before


def test_hub_revision_not_cached(existing_run, empty_offline_cache, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    fill_hub_cache(empty_offline_cache, "some-org/model", model)
    code, out, err = run_against(existing_run, "model.checkpoint=some-org/model@v2")
    assert_one_line_error(code, out, err, "model.checkpoint=some-org/model@v2 is not in the Hugging "
                                          "Face cache")


def test_hub_repository_without_config(existing_run, empty_offline_cache, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    fill_hub_cache(empty_offline_cache, "some-org/weights-only", model)
    code, out, err = run_against(existing_run, "model.checkpoint=some-org/weights-only")
    assert_one_line_error(code, out, err, "has no config.json: not a transformers model")


def _hub_error(name: str):
    """``huggingface_hub``'s own exception class ``name``, made without an HTTP response (its
    constructor wants one, of whichever HTTP library the installed version uses)."""
    from huggingface_hub import errors

    cls = getattr(errors, name)
    error = cls.__new__(cls)
    Exception.__init__(error, f"{name} from the Hub")
    return error


# What the Hub answers (this machine reaches none): the exception snapshot_download raises.
HUB_ANSWERS = {
    "RepositoryNotFoundError": ("no such model on the Hugging Face Hub and no such local directory"),
    "GatedRepoError": ("is a gated model: accept its terms on the model's Hub page, then log in"),
    "RevisionNotFoundError": ("the Hub has no revision 'v9' of some-org/model"),
}


@pytest.mark.parametrize("name", sorted(HUB_ANSWERS))
def test_hub_refusals(name, existing_run, monkeypatch):
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise _hub_error(name)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = snapshot(existing_run)
    code, out, err = run_against(existing_run, "model.checkpoint=some-org/model@v9")
    assert_one_line_error(code, out, err, HUB_ANSWERS[name])
    assert snapshot(existing_run) == before
