"""Autoregressive generation with a KV cache: greedy, or temperature + nucleus sampling.

:func:`generate` decodes eagerly through a growing :class:`KVCache`. :class:`StaticCacheDecoding`
is the model's half of compiled decoding (``tpu_train.compile.decoding`` traces it): one step
over a :class:`StaticKVCache` whose shapes never change, with the position in a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .llama.kv_cache import KVCache, StaticKVCache
from .llama.model import Llama

__all__ = ["StaticCacheDecoding", "check_sampling", "generate", "sample_next_token",
           "static_cache_step"]


def _nucleus_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose probability mass reaches ``top_p``."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # The most likely token always survives (its mass_before is zero).
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def check_sampling(temperature: float, top_p: float) -> None:
    """Reject a negative temperature or a ``top_p`` outside ``(0, 1]``."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample_next_token(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of ``logits`` ``[batch, vocab]``.

    Greedy (argmax) when ``temperature == 0``; otherwise sample from
    ``softmax(logits / temperature)`` restricted to the top-``top_p`` nucleus. Sampling uses
    the exponential-race form of a categorical draw (``argmax(p / E)``, ``E ~ Exp(1)``), so the
    random numbers can come from ``generator`` on its own device (a CPU generator works for a
    model on any device) and only a uniform tensor crosses devices.
    """
    check_sampling(temperature, top_p)
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


_SDPA_ARGUMENTS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _MaskedAttention(TorchFunctionMode):
    """Gives every ``scaled_dot_product_attention`` call ``mask`` instead of its own.

    The model's attention picks its mask from the shapes it sees (causal for a whole
    sequence, none for one new token, bottom-right causal after a prefix); a static cache is
    longer than what was written and holds left padding, so none of those is right. Overriding
    the mask here keeps every other line of the model's own forward in use."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.mask = mask

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            kwargs.update(zip(_SDPA_ARGUMENTS, args[3:]))
            args = args[:3]
            kwargs.update(attn_mask=self.mask, is_causal=False)
        return func(*args, **kwargs)


def static_cache_step(model: Llama, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
    """Logits ``[batch, vocab]`` of the last of ``tokens`` ``[batch, seq]``, which sit at slots
    ``cache.slot ... cache.slot + seq - 1``; their keys and values are written into ``cache``.

    The model's own forward runs with ``start_pos=0`` and its RoPE tables swapped for the rows
    of those slots (so the position may be a tensor), and attention masked by the cache."""
    positions = cache.slot + torch.arange(tokens.shape[1], device=tokens.device)
    tables = {"rope_cos": model.rope_cos[positions], "rope_sin": model.rope_sin[positions]}
    with _MaskedAttention(cache.attention_mask(tokens.shape[1])):
        logits = torch.func.functional_call(model, tables, (tokens,),
                                            {"start_pos": 0, "cache": cache})
    return logits[:, -1]


class StaticCacheDecoding:
    """What compiled decoding (``tpu_train.compile.decoding.CompiledDecoder``) asks of a Llama:
    plain PyTorch that the compile layer traces, so that it needs to know nothing about the
    model. The caches are one flat list: every layer's keys, then every layer's values."""

    def max_length(self, model: Llama) -> int:
        return model.config.max_seq_len

    def cache_shapes(self, model: Llama, batch: int,
                     length: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        shape = StaticKVCache.shape(model.config, batch, length)
        dtype = model.tok_embeddings.weight.dtype
        return [(shape, dtype)] * (2 * model.config.n_layers)

    def step(self, model: Llama, tokens: torch.Tensor, slot: torch.Tensor, pad: torch.Tensor,
             caches: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(last logits ``[batch, vocab]``, the caches with ``tokens``' keys and values)."""
        layers = len(caches) // 2
        cache = StaticKVCache(caches[:layers], caches[layers:], slot, pad,
                              window=model.config.sliding_window)
        logits = static_cache_step(model, tokens, cache)
        return logits, cache.keys + cache.values

    def sample(self, logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        return sample_next_token(logits, temperature, top_p)
