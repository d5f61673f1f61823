"""Recipes: one thin module per ``recipe=NAME``, each exposing ``run(cfg)``."""

from __future__ import annotations

import importlib

from omegaconf import DictConfig

from tpu_train.trainer.errors import ConfigError

RECIPES = ("llama_pretrain", "llama_finetune", "llama_lora", "generate", "eval")


def run_recipe(cfg: DictConfig) -> None:
    """Run the recipe named by ``cfg.recipe.name``."""
    name = cfg.recipe.name
    if name not in RECIPES:
        raise ConfigError(
            f"recipe.name={name!r} is not a recipe; valid names: {', '.join(RECIPES)} "
            "(select one with recipe=NAME)"
        )
    importlib.import_module(f"tpu_train.recipes.{name}").run(cfg)
