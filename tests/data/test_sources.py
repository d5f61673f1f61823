"""JSON, Parquet and saved-dataset sources, and column maps, read like JSONL files.

The oracle is the JSONL reader: the same records written as a table must give the same
examples, and a loader over a table the same batches as over the JSONL file.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.platforms import cpu_child_env, without_runtime_start_up

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from tpu_train.data.datasets import Example  # noqa: E402
from tpu_train.data.errors import DataError  # noqa: E402
from tpu_train.data.packing import PackedLoader  # noqa: E402
from tpu_train.data.padded import PaddedInstructionLoader  # noqa: E402
from tpu_train.data.sources import DataFiles, first_record_kind, read_source, source_kind  # noqa: E402

QA = [{"question": f"what is {i} plus one?", "answer": f"{i + 1}", "id": i} for i in range(30)]
CHATS = [
    {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
    for i in range(5)
]


def write_parquet(path, records, row_group_size=7):
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def examples(path, **kwargs):
    return [loc.example for chunk in read_source(path, **kwargs) for loc in chunk]


def renamed(records):
    """The records with our field names: the JSONL oracle for a column-mapped table."""
    return [{"prompt": r["question"], "response": r["answer"]} for r in records]


def test_kinds_by_extension_and_directory(tmp_path, write_jsonl):
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(QA[:2]).save_to_disk(str(saved))
    (tmp_path / "a.json").write_text("[]")
    cases = {
        write_jsonl(QA[:1], "a.jsonl"): "jsonl",
        write_jsonl(QA[:1], "a.ndjson"): "jsonl",
        write_jsonl(["line"], "a.txt"): "text",
        tmp_path / "a.json": "json",
        write_parquet(tmp_path / "a.parquet", QA[:1]): "parquet",
        saved: "saved",
    }
    assert {path.name: source_kind(path) for path in cases} == {path.name: kind for path, kind in cases.items()}


UNREADABLE = {
    "x.csv": "unknown data file type '.csv'; use .jsonl, .ndjson, .txt, .json, .parquet or a directory",
    "noext": "unknown data file type '(no extension)'",
    "plain_dir": "a directory that is not a saved dataset",
    "absent.parquet": "data file not found",
}


@pytest.mark.parametrize("name", sorted(UNREADABLE))
def test_unreadable_paths_are_named(tmp_path, name):
    path = tmp_path / name
    if name == "plain_dir":
        path.mkdir()
    elif name != "absent.parquet":
        path.write_text("{}\n")
    with pytest.raises(DataError, match="^" + re.escape(f"{path}: {UNREADABLE[name]}")):
        source_kind(path)


def test_saved_dataset_dict_names_its_splits(tmp_path):
    saved = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(QA[:2]), "test": datasets.Dataset.from_list(QA[:1])}).save_to_disk(str(saved))
    with pytest.raises(DataError, match=rf"DatasetDict \(splits: test, train\); .* e\.g\. {saved}/test"):
        source_kind(saved)


def test_column_map_on_jsonl_keeps_native_fields_and_names_missing_columns(write_jsonl):
    mapping = {"prompt": "question", "response": "answer"}
    mapped = write_jsonl(QA[:3], "qa.jsonl")
    assert examples(mapped, column_map=mapping) == examples(write_jsonl(renamed(QA[:3]), "ours.jsonl"))
    # A file already in our field names needs no mapping: one map serves a whole mixture.
    native = write_jsonl(renamed(QA[:3]), "native.jsonl")
    assert examples(native, column_map=mapping) == examples(native)
    broken = write_jsonl([{"q": "a", "answer": "b"}], "broken.jsonl")
    with pytest.raises(DataError, match=r"broken.jsonl:1: column 'question' \(data.column_map.prompt=question\) not found; the record has 'q', 'answer'"):
        examples(broken, column_map=mapping)


@pytest.mark.parametrize("layout", ["array", "lines"])
def test_json_file_reads_like_jsonl(tmp_path, write_jsonl, layout):
    path = tmp_path / "qa.json"
    text = json.dumps(QA) if layout == "array" else "\n".join(json.dumps(r) for r in QA)
    path.write_text(text)
    mapping = {"prompt": "question", "response": "answer"}
    got = examples(path, column_map=mapping, chunk_lines=4)
    assert got == examples(write_jsonl(renamed(QA)), chunk_lines=4)
    assert got[3] == Example("instruction", prompt="what is 3 plus one?", response="4")


def test_parquet_chat_and_nulls_and_row_numbers(tmp_path, write_jsonl):
    chats = write_parquet(tmp_path / "chat.parquet", CHATS)
    assert examples(chats) == examples(write_jsonl(CHATS))
    assert first_record_kind(chats) == "chat"
    # Tables give every row every column: a null cell is an absent field (alpaca's "input").
    alpaca = [{"instruction": "add", "input": "1 2", "output": "3"}, {"instruction": "greet", "input": None, "output": "hi"}]
    got = examples(write_parquet(tmp_path / "alpaca.parquet", alpaca))
    assert got == examples(write_jsonl([alpaca[0], {"instruction": "greet", "output": "hi"}], "alpaca.jsonl"))
    rows = [{"prompt": "p", "response": "r"}] * 3 + [{"prompt": "p", "response": None}]
    with pytest.raises(DataError, match=r"bad.parquet:4: missing field 'response'"):
        examples(write_parquet(tmp_path / "bad.parquet", rows))


def test_empty_and_corrupt_tables_are_one_line_errors(tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    with pytest.raises(DataError, match=rf"^{empty}: data file is empty"):
        examples(empty)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError) as error:
        examples(corrupt)
    assert str(error.value).startswith(f"{corrupt}: cannot read as parquet: ") and "\n" not in str(error.value)


@pytest.mark.parametrize("kind", ["parquet", "saved"])
def test_table_positions_resume_mid_file(tmp_path, kind):
    path = tmp_path / "qa"
    if kind == "parquet":
        path = write_parquet(tmp_path / "qa.parquet", QA)
    else:
        datasets.Dataset.from_list(QA).save_to_disk(str(path))
    mapping = {"prompt": "question", "response": "answer"}
    whole = [loc for chunk in read_source(path, chunk_lines=4, column_map=mapping) for loc in chunk]
    assert [loc.line for loc in whole] == list(range(1, 31))
    # Resume from where record 11 left off (across a row group and a chunk boundary).
    stop = whole[10]
    rest = [loc for chunk in read_source(path, offset=stop.end_offset, line=stop.line, chunk_lines=4, column_map=mapping) for loc in chunk]
    assert rest == whole[11:]


def test_loaders_over_tables_match_jsonl(tmp_path, tokenizer, write_jsonl):
    parquet = write_parquet(tmp_path / "qa.parquet", QA)
    mapping = {"prompt": "question", "response": "answer"}
    jsonl = write_jsonl(renamed(QA))
    options = dict(seq_len=16, batch_size=2, num_epochs=2, drop_last=False, read_chunk=5)
    expected = [b["tokens"].tolist() + b["labels"].tolist() for b in PackedLoader(jsonl, tokenizer, **options)]
    got = [b["tokens"].tolist() + b["labels"].tolist() for b in PackedLoader(parquet, tokenizer, column_map=mapping, **options)]
    assert got == expected and len(got) > 4
    # DataFiles carry the map to loaders that are only handed "the validation files".
    padded = list(PaddedInstructionLoader(DataFiles.of([parquet, parquet], mapping), tokenizer, batch_size=8))
    assert sum(len(b["references"]) for b in padded) == 60
    assert padded[0]["references"][:2] == ["1", "2"] and padded[-1]["references"][-1] == "30"


def test_an_open_parquet_stream_exits_cleanly(tmp_path):
    """A loader still streaming a Parquet file at exit must not print a traceback (datasets'
    generator, finalized after module teardown, would)."""
    import subprocess
    import sys

    path = write_parquet(tmp_path / "many.parquet", QA * 20, row_group_size=50)
    script = (
        "from tpu_train.data import PackedLoader, load_tokenizer\n"
        f"loader = PackedLoader({str(path)!r}, load_tokenizer(), 16, 2, column_map={{'prompt': 'question', 'response': 'answer'}})\n"
        "next(loader)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=cpu_child_env())  # no device: no chip either
    assert done.returncode == 0 and without_runtime_start_up(done.stderr) == "", done.stderr
