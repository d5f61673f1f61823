"""Loading a model for the generate and eval recipes."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig
from safetensors.torch import load_file

from . import builders
from .checkpoint import MODEL_FILE, latest_checkpoint
from .lora import apply_lora, merge_lora


def load_model_for_inference(cfg: DictConfig, tokenizer, device: torch.device):
    """(model in eval mode on ``device``, description of where its weights came from).

    Order: ``model.checkpoint``; else the newest checkpoint in ``run.dir`` (LoRA adapters are
    merged); else random weights.
    """
    if cfg.model.checkpoint is not None:
        model, source = builders.build_model(cfg, tokenizer.vocab_size), cfg.model.checkpoint
    else:
        model = builders.build_model(cfg, tokenizer.vocab_size, allow_checkpoint=False)
        found = latest_checkpoint(Path(cfg.run.dir)) if Path(cfg.run.dir).is_dir() else None
        if found is not None:
            state = load_file(str(found / MODEL_FILE))
            if any(key.endswith("lora_a") for key in state):
                lora = cfg.recipe.lora
                apply_lora(model, list(lora.targets), lora.rank, lora.alpha)
                model.load_state_dict(state)
                merge_lora(model)
            else:
                model.load_state_dict(state)
            source = str(found)
        else:
            source = f"random weights (seed {cfg.trainer.seed}): no model.checkpoint and no checkpoint in run.dir"
    return model.to(device).eval(), source
