"""Damaged ``model.checkpoint`` directories: each is one line naming the file and what is wrong
with it, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.bad_input.conftest import assert_one_line_error
from tests.trainer.cli_helpers import TINY, run_in_process, snapshot
from tests.trainer.hf_checkpoint import custom_llama  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")
transformers = pytest.importorskip("transformers")

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def checkpoint(custom_llama) -> Path:
    return custom_llama


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text(json.dumps({"prompt": "Reverse cat. ", "response": "tac"}) + "\n")
    return path


def _edit_json(name: str, **changes):
    def damage(directory: Path) -> None:
        data = json.loads((directory / name).read_text())
        for key, value in changes.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        (directory / name).write_text(json.dumps(data))
    return damage


def _write(name: str, content: str | bytes):
    def damage(directory: Path) -> None:
        write = (directory / name).write_bytes if isinstance(content, bytes) else (directory / name).write_text
        write(content)
    return damage


def _delete(*names: str):
    def damage(directory: Path) -> None:
        for name in names:
            (directory / name).unlink()
    return damage


def _truncate(directory: Path) -> None:
    data = (directory / WEIGHTS).read_bytes()
    (directory / WEIGHTS).write_bytes(data[: len(data) // 2])


def _empty_directory(directory: Path) -> None:
    for entry in directory.iterdir():
        entry.unlink()


def _bin_only(directory: Path) -> None:
    (directory / WEIGHTS).rename(directory / "pytorch_model.bin")


def _sharded_index(weight_map: dict | str):
    def damage(directory: Path) -> None:
        (directory / WEIGHTS).rename(directory / "model-00001-of-00001.safetensors")
        index = weight_map if isinstance(weight_map, str) else json.dumps({"weight_map": weight_map})
        (directory / "model.safetensors.index.json").write_text(index)
    return damage


def _rewrite_weights(change):
    def damage(directory: Path) -> None:
        from safetensors.torch import load_file, save_file

        state = load_file(str(directory / WEIGHTS))
        change(state)
        save_file(state, str(directory / WEIGHTS), metadata={"format": "pt"})
    return damage


def _drop_a_tensor(state: dict) -> None:
    del state["model.norm.weight"]


def _wrong_shape(state: dict) -> None:
    state["model.norm.weight"] = state["model.norm.weight"][:-1].clone()


def _nan_weights(state: dict) -> None:
    state["model.norm.weight"][0] = float("nan")


# name: (damage, extra overrides, text the error line must contain)
CASES = {
    "empty_directory": (_empty_directory, [], "config.json not found"),
    "no_config": (_delete("config.json"), [], "config.json not found"),
    "config_not_json": (_write("config.json", '{"model_type": "llama", '), [],
                        "config.json: not readable JSON"),
    "config_not_an_object": (_write("config.json", "[1, 2]"), [], "config.json"),
    "other_architecture": (_edit_json("config.json", model_type="gpt2",
                                      architectures=["GPT2LMHeadModel"]), [],
                           "architectures=['GPT2LMHeadModel']"),
    # Settings no attention path here can honour: Qwen2's window on some layers only, and a
    # Mistral window that is no number of positions.
    "qwen2_window_on_some_layers": (_edit_json("config.json", model_type="qwen2",
                                               architectures=["Qwen2ForCausalLM"],
                                               use_sliding_window=True), [],
                                    "Qwen2 with use_sliding_window=true"),
    "mistral_window_not_positive": (_edit_json("config.json", model_type="mistral",
                                               architectures=["MistralForCausalLM"],
                                               sliding_window=0), [],
                                    "sliding_window must be a positive integer or null, got 0"),
    "config_without_hidden_size": (_edit_json("config.json", hidden_size=None), [], "hidden_size"),
    "heads_not_dividing_hidden": (_edit_json("config.json", num_attention_heads=7,
                                             head_dim=None), [], "config.json"),
    "kv_heads_not_dividing_heads": (_edit_json("config.json", num_key_value_heads=4), [],
                                    "config.json"),
    "negative_layers": (_edit_json("config.json", num_hidden_layers=-1), [],
                        "n_layers must be a positive int, got -1"),
    "no_weights": (_delete(WEIGHTS), [], "safetensors"),
    "bin_weights_only": (_bin_only, [], "pytorch_model.bin"),
    "truncated_weights": (_truncate, [], WEIGHTS),
    "garbage_weights": (_write(WEIGHTS, b"\x00garbage" * 64), [], WEIGHTS),
    "empty_weights": (_write(WEIGHTS, b""), [], WEIGHTS),
    "index_not_json": (_sharded_index("{not json"), [], "model.safetensors.index.json"),
    "index_names_missing_shard": (_sharded_index({"model.norm.weight": "model-2.safetensors"}), [],
                                  "model-2.safetensors"),
    "weights_missing_a_tensor": (_rewrite_weights(_drop_a_tensor), [], "model.norm.weight"),
    "weights_of_another_shape": (_rewrite_weights(_wrong_shape), [], "model.norm.weight"),
    "non_finite_weights": (_rewrite_weights(_nan_weights), [], "model.norm.weight"),
    "no_tokenizer": (_delete("tokenizer.json"), [],
                     "holds no tokenizer (tokenizer.json or tokenizer.model)"),
    "tokenizer_not_json": (_write("tokenizer.json", "{oops"), [], "tokenizer.json"),
    "tokenizer_config_not_json": (_write("tokenizer_config.json", "{oops"), [],
                                  "tokenizer_config.json"),
    "unknown_special_token": (_edit_json("tokenizer_config.json", eos_token="<|not-in-vocab|>"), [],
                              "names eos token '<|not-in-vocab|>'"),
    # The bundled 512-token tokenizer with this smaller model: ids beyond its embedding rows.
    "vocabulary_mismatch": (None, ["data.tokenizer=BUNDLED"], "ids >= "),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_checkpoint_is_a_one_line_error(name, checkpoint, train_file, tmp_path):
    from tpu_train.data import default_tokenizer_path

    damage, extra, expected = CASES[name]
    bad = tmp_path / "ckpt"
    shutil.copytree(checkpoint, bad)
    if damage is not None:
        damage(bad)
    extra = [e.replace("BUNDLED", str(default_tokenizer_path())) for e in extra]
    before = snapshot(tmp_path)
    code, out, err = run_in_process(f"model.checkpoint={bad}", "data=jsonl",
                                    f"data.path={train_file}", *TINY, "trainer.max_steps=1",
                                    f"run.dir={tmp_path / 'run'}", *extra)
    assert_one_line_error(code, out, err, expected)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("recipe", ["eval", "generate"])
def test_inference_recipes_on_a_damaged_checkpoint(recipe, checkpoint, train_file, tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(checkpoint, bad)
    _truncate(bad)
    before = snapshot(tmp_path)
    code, out, err = run_in_process(f"recipe={recipe}", f"model.checkpoint={bad}", "data=jsonl",
                                    f"data.path={train_file}", f"data.val_path={train_file}",
                                    "trainer.device=cpu", "trainer.mode=eager", "data.seq_len=32",
                                    f"run.dir={tmp_path / 'run'}")
    assert_one_line_error(code, out, err, WEIGHTS)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("checksums", [True, False])
def test_a_damaged_step_checkpoint_as_model_checkpoint(checksums, existing_run, tmp_path):
    """model.checkpoint=<a run's step_N folder> whose model.safetensors is truncated: named as
    damaged by its SHA-256; a checkpoint from before the sums (no ``files`` in meta.json) fails
    reading, also as one line."""
    step = tmp_path / "step_00000001"
    shutil.copytree(existing_run / "checkpoints" / "step_00000001", step)
    _truncate(step)
    if not checksums:
        meta = json.loads((step / "meta.json").read_text())
        meta.pop("files")
        (step / "meta.json").write_text(json.dumps(meta))
    before = snapshot(tmp_path)
    code, out, err = run_in_process(f"model.checkpoint={step}", "model=debug_tiny", *TINY,
                                    "trainer.max_steps=1", f"run.dir={tmp_path / 'run'}")
    expected = ("is damaged (model.safetensors does not match its SHA-256" if checksums
                else "model.safetensors cannot be read (SafetensorError")
    assert_one_line_error(code, out, err, expected)
    assert snapshot(tmp_path) == before
