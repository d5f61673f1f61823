"""Autoregressive generation with a KV cache: greedy, or temperature + nucleus sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .kv_cache import KVCache
from .llama import Llama

__all__ = ["generate", "sample_next_token"]


def _nucleus_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose probability mass reaches ``top_p``."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # The most likely token always survives (its mass_before is zero).
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def sample_next_token(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of ``logits`` ``[batch, vocab]``.

    Greedy (argmax) when ``temperature == 0``; otherwise sample from
    ``softmax(logits / temperature)`` restricted to the top-``top_p`` nucleus. Sampling uses
    the exponential-race form of a categorical draw (``argmax(p / E)``, ``E ~ Exp(1)``), so the
    random numbers can come from ``generator`` on its own device (a CPU generator works for a
    model on any device) and only a uniform tensor crosses devices.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        probs = _nucleus_filter(probs, top_p)
    noise_device = generator.device if generator is not None else probs.device
    uniform = torch.rand(probs.shape, generator=generator, device=noise_device)
    # u lies in [0, 1); clamping away u == 0 keeps the exponential draw finite and positive,
    # so a zero-probability token can never win the race.
    exponential = -torch.log(uniform.clamp_min(torch.finfo(uniform.dtype).tiny))
    exponential = exponential.to(probs.device)
    return (probs / exponential).argmax(dim=-1)


@torch.no_grad()
def generate(model: Llama, prompt_tokens: torch.Tensor | Sequence[Sequence[int]],
             max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             eos_token_id: int | Sequence[int] | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue a batch of equal-length prompts ``[batch, prompt_len]``.

    Returns ``[batch, prompt_len + n]`` token ids (prompt included) on the model's device, with
    ``n <= max_new_tokens``: generation stops early once every row has produced one of
    ``eos_token_id``, and a row that has finished is padded with its first eos id. The prompt
    is processed in one forward, then one token per step through a KV cache sized
    ``prompt_len + max_new_tokens`` (which must fit in ``model.config.max_seq_len``).
    """
    weight = model.tok_embeddings.weight
    tokens = torch.as_tensor(prompt_tokens, dtype=torch.long)
    tokens = tokens.to(weight.device)
    if tokens.dim() != 2 or tokens.shape[1] == 0:
        raise ValueError(
            f"prompt_tokens must be [batch, prompt_len] with prompt_len >= 1, got shape "
            f"{tuple(tokens.shape)}; batch prompts must share one length"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    batch, prompt_len = tokens.shape
    total = prompt_len + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(
            f"prompt_len + max_new_tokens = {prompt_len} + {max_new_tokens} = {total} exceeds "
            f"the model's max_seq_len {model.config.max_seq_len}"
        )
    if max_new_tokens == 0:
        return tokens
    eos_ids = None
    if eos_token_id is not None:
        ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        eos_ids = torch.tensor(ids, dtype=torch.long, device=tokens.device)

    cache = KVCache.for_model(model, batch, total)
    logits = model(tokens, start_pos=0, cache=cache)[:, -1]
    pieces = [tokens]
    finished = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    position = prompt_len
    for step in range(max_new_tokens):
        next_token = sample_next_token(logits, temperature, top_p, generator)
        if eos_ids is not None:
            next_token = torch.where(finished, eos_ids[0], next_token)
            finished = finished | (next_token[:, None] == eos_ids).any(dim=-1)
        pieces.append(next_token[:, None])
        if step == max_new_tokens - 1 or (eos_ids is not None and bool(finished.all())):
            break
        logits = model(next_token[:, None], start_pos=position, cache=cache)[:, -1]
        position += 1
    return torch.cat(pieces, dim=1)
