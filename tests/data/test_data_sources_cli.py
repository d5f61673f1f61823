"""``tpu-train`` with the data users have: Parquet, JSON, saved datasets, mixtures, column maps.

Runs go through the CLI in-process with the tiny settings of tests/trainer/cli_helpers.py, and
assert on what the run wrote: the data position in the checkpoint shows which files were read.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.trainer.cli_helpers import TINY, one_thread, read_metrics, run_in_process, snapshot  # noqa: F401

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.usefixtures("one_thread")

QA_MAP = "data.column_map={prompt:question,response:answer}"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """a.jsonl in our field names, b.parquet and c.json with question/answer columns."""
    root = tmp_path_factory.mktemp("sources")
    with (root / "a.jsonl").open("w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"add one to {i}", "response": f"{i + 1}"}) + "\n")
    rows = [{"question": f"what is {i} times two?", "answer": f"{2 * i}"} for i in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), root / "b.parquet", row_group_size=8)
    (root / "c.json").write_text(json.dumps(rows[:10]))
    (root / "x.csv").write_text("question,answer\n")
    (root / "plain_dir").mkdir()
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3])}).save_to_disk(str(root / "dd"))
    return root


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    """A run directory holding a real checkpoint from a 1-step run."""
    run_dir = tmp_path_factory.mktemp("existing") / "run"
    code, _, err = run_in_process(*TINY, "trainer.max_steps=1", f"run.dir={run_dir}")
    assert code == 0, err
    return run_dir


def data_state(run_dir, step):
    path = run_dir / "checkpoints" / f"step_{step:08d}" / "training_state.pt"
    return torch.load(path, weights_only=False)["data"]


def _assert_one_line_error(code, out, err, expected):
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tpu-train: error: "), lines[0]
    assert expected in lines[0], lines[0]


# {d} is the directory of the files fixture.
BAD_SOURCES = {
    "weights_length": (["data.path=[{d}/a.jsonl,{d}/b.parquet]", "data.weights=[1.0]"],
                       "data.weights has 1 values but data.path has 2 files; give one weight per file"),
    "negative_weight": (["data.path=[{d}/a.jsonl,{d}/b.parquet]", "data.weights=[0.7,-0.3]"],
                        "data.weights[1]=-0.3 (for {d}/b.parquet) must be positive"),
    "weights_for_one_file": (["data.path={d}/a.jsonl", "data.weights=[1.0]"],
                             "data.weights needs a list of files in data.path"),
    "missing_column": (["data.path=[{d}/a.jsonl,{d}/b.parquet]", "data.weights=[0.99,0.01]",
                        "data.column_map={prompt:question,response:reply}"],
                       "{d}/b.parquet:1: column 'reply' (data.column_map.response=reply) not found; "
                       "the record has 'question', 'answer'"),
    # a.jsonl has our "prompt"; the second validation file has neither it nor "q".
    "val_missing_column": (["data.path={d}/a.jsonl", "data.val_path=[{d}/a.jsonl,{d}/c.json]",
                            "data.column_map={prompt:q}"],
                           "{d}/c.json:1: column 'q' (data.column_map.prompt=q) not found"),
    "unknown_field": (["data.path={d}/b.parquet", "data.column_map={promt:question}"],
                      "data.column_map key 'promt' is not a field; mappable fields: text, prompt"),
    "unknown_extension": (["data.path=[{d}/a.jsonl,{d}/x.csv]"],
                          "data.path: {d}/x.csv: unknown data file type '.csv'; use .jsonl"),
    "plain_directory": (["data.path={d}/plain_dir"],
                        "data.path: {d}/plain_dir: a directory that is not a saved dataset"),
    "dataset_dict": (["data.path={d}/dd"], "a saved DatasetDict (splits: train); point the path at one "
                                           "split's directory, e.g. {d}/dd/train"),
    "empty_list": (["data.path=[]"], "data.path must be a path or a non-empty list of paths"),
}


@pytest.mark.parametrize("name", sorted(BAD_SOURCES))
def test_bad_sources_are_one_line_and_write_nothing(name, files, existing_run):
    overrides, expected = BAD_SOURCES[name]
    before = snapshot(existing_run)
    code, out, err = run_in_process(*TINY, "trainer.max_steps=2", f"run.dir={existing_run}", "data=jsonl",
                                    *(o.replace("{d}", str(files)) for o in overrides))
    _assert_one_line_error(code, out, err, expected.replace("{d}", str(files)))
    assert snapshot(existing_run) == before


def test_parquet_trains_and_validates_through_the_cli(files, tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*TINY, "trainer.max_steps=2", f"run.dir={run_dir}", "data=jsonl",
                                    f"data.path={files}/b.parquet", f"data.val_path={files}/c.json",
                                    QA_MAP, "data.shuffle_buffer=0", "trainer.val_every_n_steps=2",
                                    "data.template=none",  # samples of ~12 tokens, as written
                                    "trainer.val_batches=1", "recipe.eval.exact_match_examples=1")
    assert code == 0, err
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == [1, 2] and all(math.isfinite(m["train/loss"]) for m in metrics.values())
    state = data_state(run_dir, 2)
    # Two batches of 2 x 32 tokens from ~12-token samples: well past row 1, within the file.
    assert state["files"] == ["b.parquet"] and state["weights"] is None
    assert 5 < state["offset"] == state["line"] < 30 and state["epoch"] == 0
    validation = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if "val/loss" in line]
    assert validation and math.isfinite(validation[-1]["val/loss"]), validation


def test_mixture_trains_and_resumes_exactly_through_the_cli(files, tmp_path):
    run_dir = tmp_path / "run"
    common = [*TINY, "trainer.max_steps=4", "checkpoint.every_n_steps=2", f"run.dir={run_dir}", "data=jsonl",
              f"data.path=[{files}/a.jsonl,{files}/b.parquet]", "data.weights=[0.7,0.3]", QA_MAP,
              "data.shuffle_buffer=0"]
    code, out, err = run_in_process(*common)
    assert code == 0, err
    first = {step: record["train/loss"] for step, record in read_metrics(run_dir).items()}
    state = data_state(run_dir, 4)
    assert state["files"] == ["a.jsonl", "b.parquet"] and state["weights"] == [0.7, 0.3]
    # Both files were drawn from (a.jsonl: bytes read; b.parquet: rows read).
    assert all(s["offset"] > 0 for s in state["streams"]), state["streams"]

    before = snapshot(run_dir)
    code, out, err = run_in_process(*common[:-3], "data.weights=[0.5,0.5]", *common[-2:],
                                    "checkpoint.load_step=2")
    _assert_one_line_error(code, out, err, "weights=[0.7, 0.3], but this loader reads")
    assert snapshot(run_dir) == before

    code, out, err = run_in_process(*common, "checkpoint.load_step=2")
    assert code == 0, err
    assert "(resumed from step_00000002)" in out
    again = {step: record["train/loss"] for step, record in read_metrics(run_dir).items()}
    assert again == first  # steps 3 and 4 replayed bit for bit from the mixture's position
