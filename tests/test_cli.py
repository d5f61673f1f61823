"""The ``tpu-train`` command line: help, printing the config, multirun and one-line errors
(the bad configurations and overrides are in tests/bad_input/)."""

from __future__ import annotations

import pytest

from tests.trainer.cli_helpers import TINY, one_thread, run_in_process, snapshot  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    """A run directory holding a real checkpoint from a 1-step run."""
    run_dir = tmp_path_factory.mktemp("existing") / "run"
    code, _, err = run_in_process(*TINY, "trainer.max_steps=1", f"run.dir={run_dir}")
    assert code == 0, err
    return run_dir


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "empty.jsonl").write_text("")
    (root / "broken.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    (root / "nofield.jsonl").write_text('{"title": "no text here"}\n')
    (root / "notdict.jsonl").write_text('[1, 2, 3]\n')
    return root


BAD_DATA = {
    "empty_file": ("empty.jsonl", "empty"),
    "broken_json": ("broken.jsonl", "broken.jsonl:2"),
    "missing_field": ("nofield.jsonl", "nofield.jsonl:1"),
    "not_an_object": ("notdict.jsonl", "notdict.jsonl:1"),
}


def _assert_one_line_error(code, out, err, expected):
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tpu-train: error: "), lines[0]
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize("name", sorted(BAD_DATA))
def test_bad_data_is_one_line_and_writes_nothing(name, existing_run, bad_data):
    filename, expected = BAD_DATA[name]
    before = snapshot(existing_run)
    code, out, err = run_in_process(*TINY, "trainer.max_steps=2", f"run.dir={existing_run}",
                                    "data=jsonl", f"data.path={bad_data / filename}")
    _assert_one_line_error(code, out, err, expected)
    assert snapshot(existing_run) == before


def test_help_lists_recipes():
    code, out, err = run_in_process("--help")
    assert code == 0, err
    for recipe in ("llama_pretrain", "llama_finetune", "llama_lora", "generate", "eval"):
        assert recipe in out
    assert "recipe: eval, generate, llama_finetune, llama_lora, llama_pretrain" in out
    assert "model: debug_tiny, debug_tiny_base, llama2_7b" in out


def test_cfg_job_prints_composed_config():
    code, out, err = run_in_process("recipe=llama_lora", "trainer.seed=7", "--cfg", "job")
    assert code == 0, err
    assert "name: llama_lora" in out and "seed: 7" in out and "rank: 8" in out


def test_multirun_gives_each_job_its_own_run_dir(tmp_path):
    base = tmp_path / "sweep"
    code, out, err = run_in_process("-m", *TINY, "trainer.max_steps=1", f"run.dir={base}",
                                    "trainer.seed=1,2")
    assert code == 0, err
    for job in ("0", "1"):
        assert (base / job / "checkpoints" / "step_00000001" / "meta.json").is_file()
    seeds = [(base / job / "run_config.yaml").read_text() for job in ("0", "1")]
    assert "seed: 1" in seeds[0] and "seed: 2" in seeds[1]


@pytest.mark.parametrize("where", ["empty", "a_file", "under_a_file"])
def test_unusable_run_dir_is_one_line_and_writes_nothing(where, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    run_dir = {"empty": "", "a_file": str(blocker), "under_a_file": str(blocker / "run")}[where]
    expected = {"empty": "run.dir is empty", "a_file": "is a file, not a directory",
                "under_a_file": "which is a file"}[where]
    before = snapshot(tmp_path)
    code, out, err = run_in_process(*TINY, "trainer.max_steps=1", f"run.dir={run_dir}")
    _assert_one_line_error(code, out, err, expected)
    assert snapshot(tmp_path) == before


def test_bad_platform_is_one_line(tmp_path):
    """TPU_TRAIN_PLATFORM is read when tpu_train is imported: a child process each."""
    import os
    import subprocess
    import sys

    cases = {"bogus": "is not a known platform", "tpu": "but JAX finds no tpu devices"}
    for value, expected in cases.items():
        env = dict(os.environ, TPU_TRAIN_PLATFORM=value)
        done = subprocess.run([sys.executable, "-m", "tpu_train.cli", *TINY, "trainer.device=tpu",
                               "trainer.max_steps=1", f"run.dir={tmp_path / value}"],
                              env=env, capture_output=True, text=True, timeout=120)
        _assert_one_line_error(done.returncode, done.stdout, done.stderr, expected)
        assert not (tmp_path / value).exists()
