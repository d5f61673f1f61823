"""Every YAML under configs/ composes against the typed schema."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tpu_train.cli import CONFIG_DIR
from tpu_train.trainer.config import register_schema

CONFIGS = Path(CONFIG_DIR)
GROUP_OPTIONS = sorted(
    (path.parent.name, path.stem) for path in CONFIGS.rglob("*.yaml") if path.parent != CONFIGS
)


@pytest.fixture(scope="module", autouse=True)
def schema():
    register_schema()


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_every_group_yaml_is_covered():
    assert {group for group, _ in GROUP_OPTIONS} == {
        "model", "data", "optim", "scheduler", "parallel", "checkpoint", "logging", "recipe"}


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if group == "data" and option == "jsonl":
        overrides.append("data.path=train.jsonl")
    cfg = _compose(overrides)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    if group == "recipe":
        assert cfg.recipe.name == option


@pytest.mark.parametrize("path", sorted((CONFIGS / "recipe").glob("*.yaml")), ids=lambda p: p.stem)
def test_recipe_yaml_starts_with_its_command(path):
    lines = path.read_text().splitlines()
    # Hydra reads a package header only from the very first lines.
    first = lines[1] if lines[0].startswith("# @package ") else lines[0]
    # eval and generate also name the model they evaluate (they refuse to run without one).
    assert first == f"# tpu-train recipe={path.stem}" or first.startswith(
        f"# tpu-train recipe={path.stem} model=")


def test_required_keys_exist_with_defaults():
    cfg = _compose([])
    assert cfg.recipe.name == "llama_finetune"
    # The embedded default, like every other model, gets the schema's compiled step on the tpu
    # device; its preset only sets the fine-tuning batch.
    assert cfg.trainer.mode.name == "compiled" and cfg.trainer.device == "tpu"
    assert cfg.data.batch_size == 16
    other = _compose(["model=llama3_2_1b"])
    assert other.trainer.mode.name == "compiled" and other.trainer.device == "tpu"
    assert _compose(["recipe=llama_pretrain"]).trainer.mode.name == "compiled"
    for key in ("trainer.max_steps", "trainer.seed", "checkpoint.every_n_steps",
                "checkpoint.keep_last", "run.dir", "parallel.data", "parallel.fsdp",
                "parallel.tensor", "plan.chip", "model.checkpoint", "data.path"):
        assert OmegaConf.select(cfg, key, throw_on_missing=False, default="absent") != "absent", key
    assert str(cfg.run.dir).startswith("runs/llama_finetune/")


def test_default_fine_tunes_the_bundled_base_model():
    from tpu_train.trainer.config import asset_path

    cfg = _compose([])
    assert cfg.model.name == "debug_tiny" and cfg.model.checkpoint == asset_path("base_model")
    assert (Path(cfg.model.checkpoint) / "config.json").is_file()
    assert cfg.optim.lr == pytest.approx(5e-4) and cfg.trainer.max_steps != 100
    assert cfg.trainer.cpu_threads == 1
    # Another model option drops the preset's training settings; the command line beats them.
    plain = _compose(["model=llama3_2_1b"])
    assert plain.model.checkpoint is None and plain.optim.lr == pytest.approx(1e-4)
    assert plain.trainer.max_steps == 100 and plain.recipe.eval.exact_match_examples == 32
    assert plain.trainer.cpu_threads is None and plain.data.batch_size == 8
    assert _compose(["optim.lr=5e-4", "trainer.max_steps=7"]).optim.lr == pytest.approx(5e-4)
    assert _compose(["recipe=llama_pretrain"]).model.checkpoint is None


def test_recipe_overrides_other_groups():
    from tpu_train.trainer.config import asset_path

    cfg = _compose(["recipe=llama_lora"])
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.recipe.lora.rank == 8
    # LoRA adapts the bundled base model by default, with the LoRA learning rate.
    assert cfg.model.checkpoint == asset_path("base_model")
    assert _compose(["recipe=llama_lora", "model=llama3_2_1b"]).optim.lr == pytest.approx(1e-3)
    assert _compose(["recipe=llama_lora", "optim.lr=5e-4"]).optim.lr == pytest.approx(5e-4)
    assert _compose(["recipe=llama_pretrain"]).scheduler.name.name == "wsd"


def test_model_n_layers_and_max_seq_len_change_what_is_built_and_planned():
    """``model.n_layers`` shortens a preset and ``model.max_seq_len`` lengthens its context,
    for the model the trainer builds and the one the planner plans."""
    from tpu_train.planning.estimate import estimate_from_config
    from tpu_train.trainer.builders import model_config

    cfg = _compose(["model=llama3_1_8b", "model.n_layers=2", "model.max_seq_len=16384",
                    "data.seq_len=16384", "data.batch_size=1"])
    built = model_config(cfg)
    assert (built.n_layers, built.max_seq_len, built.dim) == (2, 16384, 4096)
    full = _compose(["model=llama3_1_8b", "data.seq_len=4096", "data.batch_size=1"])
    short = _compose(["model=llama3_1_8b", "model.n_layers=2", "data.seq_len=4096",
                      "data.batch_size=1"])
    # A layer: q, k, v, o (8 kv heads of 128), the SwiGLU's three 4096 x 14336, two norms.
    per_layer = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096
    params = [estimate_from_config(c, num_devices=1)["num_params"] for c in (full, short)]
    assert params[0] - params[1] == 30 * per_layer
