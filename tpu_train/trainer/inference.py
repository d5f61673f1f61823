"""Loading a model for the generate and eval recipes."""

from __future__ import annotations

import sys

import torch
from omegaconf import DictConfig

from . import builders
from .checkpoint import latest_intact_checkpoint, read_model_state
from .errors import ConfigError
from .lora import apply_lora, merge_lora
from .storage_urls import RunPath, run_path


def load_model_for_inference(cfg: DictConfig, tokenizer, device: torch.device):
    """(model in eval mode on ``device``, description of where its weights came from).

    The weights are ``model.checkpoint``'s, else those of the newest intact checkpoint in
    ``run.dir`` (LoRA adapters are merged). Neither is a :class:`ConfigError`: evaluating or
    sampling random weights would print plausible numbers about no model at all.
    """
    if cfg.model.checkpoint is not None:
        return builders.build_model(cfg, tokenizer.vocab_size).to(device).eval(), cfg.model.checkpoint
    model = builders.build_model(cfg, tokenizer.vocab_size, allow_checkpoint=False)
    found = newest_run_checkpoint(cfg)
    try:
        state = read_model_state(found)
    except ValueError as exc:  # sharded or damaged: the message says what to use instead
        raise ConfigError(str(exc)) from None
    if any(key.endswith("lora_a") for key in state):
        lora = cfg.recipe.lora
        apply_lora(model, list(lora.targets), lora.rank, lora.alpha)
        if "tok_embeddings.weight" not in state:
            raise ConfigError(
                f"{found} holds LoRA adapters only (its run stored the base in int8, "
                "model.base_dtype=int8, and rebuilds it from model.checkpoint); use the run's "
                f"merged export: model.checkpoint={run_path(cfg.run.dir) / 'hf'}")
        model.load_state_dict(state)
        merge_lora(model)
    else:
        model.load_state_dict(state)
    return model.to(device).eval(), str(found)


def newest_run_checkpoint(cfg: DictConfig) -> RunPath:
    """The newest intact checkpoint of ``run.dir`` (a damaged newer one is named in a warning)."""
    recipe, run_dir = cfg.recipe.name, run_path(cfg.run.dir)
    needs = (f"recipe={recipe} needs a model: set model.checkpoint=DIR (a Hugging Face "
             "directory) or run.dir=<a run that holds checkpoints>")
    if not run_dir.is_dir():
        raise ConfigError(f"{needs}; run.dir={cfg.run.dir!r} does not exist")
    found, damaged = latest_intact_checkpoint(run_dir)
    if found is None and damaged:
        raise ConfigError(f"{needs}; every checkpoint in run.dir={cfg.run.dir!r} is damaged "
                          f"(newest {damaged[0][0].name}: {damaged[0][1]})")
    if found is None:
        raise ConfigError(f"{needs}; run.dir={cfg.run.dir!r} holds no checkpoint")
    for path, problem in damaged:
        print(f"tpu-train: warning: checkpoint {path} is damaged ({problem}); using the newest "
              f"intact one, {found}", file=sys.stderr, flush=True)
    return found
