"""Validation loss, perplexity and exact match of generated answers."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .step import IGNORE_INDEX, autocast_context, causal_lm_loss_sum


@torch.no_grad()
def validation_loss(model: torch.nn.Module, loader, device: torch.device, max_batches: int,
                    precision) -> dict[str, float]:
    """Token-weighted mean loss over at most ``max_batches`` batches, and its perplexity."""
    model.eval()
    total, tokens = 0.0, 0
    for index, batch in enumerate(loader):
        if index >= max_batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast_context(device, precision):
            total += float(causal_lm_loss_sum(model, batch))
        tokens += int((batch["labels"] != IGNORE_INDEX).sum())
    model.train()
    if tokens == 0:
        return {}
    loss = total / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def exact_match_score(model: torch.nn.Module, tokenizer, path: Path, device: torch.device,
                      max_examples: int, max_new_tokens: int) -> float | None:
    """Greedy-decoded answers compared with the references of an instruction/chat file.

    Prompts are decoded one at a time: batched prompts would need padding the model cannot
    mask.  Returns None when ``max_examples`` is 0.
    """
    result = exact_match_count(model, tokenizer, path, device, max_examples, max_new_tokens)
    return None if result is None else result[0]


@torch.no_grad()
def exact_match_count(model: torch.nn.Module, tokenizer, path: Path, device: torch.device,
                      max_examples: int, max_new_tokens: int) -> tuple[float, int] | None:
    """(exact match, number of examples scored) as in :func:`exact_match_score`."""
    from tpu_train.data import PaddedInstructionLoader, exact_match, extract_response
    from tpu_train.models import generate

    if max_examples == 0:
        return None
    model.eval()
    predictions, references = [], []
    limit = model.config.max_seq_len - max_new_tokens
    for batch in PaddedInstructionLoader(path, tokenizer, batch_size=1):
        if len(references) >= max_examples:
            break
        prompt = batch["prompt_tokens"][:, -int(batch["prompt_lengths"][0]):][:, -limit:]
        out = generate(model, prompt.to(device), max_new_tokens,
                       eos_token_id=tokenizer.eos_id)
        text = tokenizer.decode(out[0, prompt.shape[1]:].tolist(), skip_special=False)
        predictions.append(extract_response(text))
        references.append(batch["references"][0])
    model.train()
    return (exact_match(predictions, references), len(references)) if references else None
