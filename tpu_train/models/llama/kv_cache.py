"""Key/value cache for incremental decoding."""

from __future__ import annotations

import torch
from torch import nn

from .config import LlamaConfig

__all__ = ["KVCache"]


class KVCache:
    """Pre-allocated per-layer keys and values, ``[batch, n_kv_heads, slots, head_dim]``.

    Keys are stored after RoPE, so a cached position never needs re-rotating. The caller
    passes ``start_pos`` to each forward; the cache itself does not track a cursor, so one
    cache can be rewound by simply decoding from an earlier position again.

    With a sliding window (``cfg.sliding_window``, Mistral) no query ever sees a key more than
    ``window - 1`` positions back, so the cache holds ``min(max_seq_len, window)`` slots, a
    ring: position ``p`` lives in slot ``p % slots``. :meth:`update` then returns the
    ``window - 1`` positions before the new block (fewer at the start) and the block itself,
    in order, which is what the attention's bottom-right aligned window mask expects. Such a
    cache rewinds only within the last ``window`` positions.
    """

    def __init__(self, cfg: LlamaConfig, batch_size: int, max_seq_len: int | None = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        max_seq_len = cfg.max_seq_len if max_seq_len is None else max_seq_len
        if batch_size <= 0:
            raise ValueError(f"KVCache batch_size must be > 0, got {batch_size}")
        if not 0 < max_seq_len <= cfg.max_seq_len:
            raise ValueError(
                f"KVCache max_seq_len must be in [1, config.max_seq_len={cfg.max_seq_len}], "
                f"got {max_seq_len}"
            )
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.window = cfg.sliding_window
        self.slots = max_seq_len if self.window is None else min(max_seq_len, self.window)
        shape = (batch_size, cfg.n_kv_heads, self.slots, cfg.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]

    @classmethod
    def for_model(cls, model: nn.Module, batch_size: int,
                  max_seq_len: int | None = None) -> "KVCache":
        """A cache matching ``model``'s config, parameter dtype and device."""
        weight = model.tok_embeddings.weight
        return cls(model.config, batch_size, max_seq_len, dtype=weight.dtype, device=weight.device)

    def update(self, layer: int, start_pos: int, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys``/``values`` (``[batch, n_kv_heads, seq, head_dim]``) at ``start_pos`` and
        return everything cached for this layer up to the end of the new block (under a
        sliding window: its last ``window - 1`` positions before the block, and the block)."""
        batch, _, seq, _ = keys.shape
        end = start_pos + seq
        if batch != self.batch_size:
            raise ValueError(
                f"KVCache was allocated for batch size {self.batch_size}, got a batch of {batch}"
            )
        if end > self.max_seq_len:
            raise ValueError(
                f"KVCache holds {self.max_seq_len} positions but positions up to {end} were "
                f"requested (start_pos={start_pos}, seq={seq}); allocate a longer cache"
            )
        if self.slots == self.max_seq_len:
            self.keys[layer][:, :, start_pos:end].copy_(keys)
            self.values[layer][:, :, start_pos:end].copy_(values)
            return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        return self._ring_update(layer, start_pos, keys, values)

    def _ring_update(self, layer: int, start_pos: int, keys: torch.Tensor,
                     values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = keys.shape[2]
        kept = min(start_pos, self.window - 1)
        device = keys.device
        earlier = torch.arange(start_pos - kept, start_pos, device=device) % self.slots
        # Only the block's last `slots` positions outlive it.
        last = min(seq, self.slots)
        written = torch.arange(start_pos + seq - last, start_pos + seq, device=device) % self.slots
        out = []
        for store, new in ((self.keys[layer], keys), (self.values[layer], values)):
            out.append(torch.cat([store.index_select(2, earlier), new], dim=2))
            store.index_copy_(2, written, new[:, :, seq - last:].to(store.dtype))
        return out[0], out[1]


class StaticKVCache:
    """Fixed-length per-layer keys and values for a batch of left-padded rows, written at a
    position held in a tensor (``slot``), for decoding loops whose shapes never change.

    Slot ``j`` of every row holds position ``j``; row ``b``'s real tokens start at slot
    ``pad[b]`` (the slots before are left padding). RoPE attention depends only on the
    distance between positions, so a row shifted right by its padding attends exactly as it
    would from position 0. :meth:`update` writes the new block at ``slot + start_pos`` and
    returns the *whole* cache (all ``length`` slots): the caller must mask attention with
    :meth:`attention_mask` (unwritten slots and padding hold no real keys).
    Everything is a tensor operation on ``slot``/``pad``, so one traced graph serves every
    position (:func:`tpu_train.models.generation.static_cache_step`). With a sliding
    ``window`` (Mistral), a query sees only the last ``window`` slots up to its own.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 slot: torch.Tensor, pad: torch.Tensor, window: int | None = None):
        self.keys, self.values = list(keys), list(values)
        self.slot, self.pad = slot, pad
        self.window = window
        self.length = keys[0].shape[2]

    @staticmethod
    def shape(cfg: LlamaConfig, batch_size: int, length: int) -> tuple[int, int, int, int]:
        """The shape of one layer's keys (and values)."""
        return (batch_size, cfg.n_kv_heads, length, cfg.head_dim)

    def update(self, layer: int, start_pos: int, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys``/``values`` ``[batch, n_kv_heads, seq, head_dim]`` at slots
        ``slot + start_pos ...`` and return this layer's whole cache."""
        index = self.slot + start_pos + torch.arange(keys.shape[2], device=keys.device)
        self.keys[layer] = self.keys[layer].index_copy(2, index, keys.to(self.keys[layer].dtype))
        self.values[layer] = self.values[layer].index_copy(
            2, index, values.to(self.values[layer].dtype))
        return self.keys[layer], self.values[layer]

    def attention_mask(self, seq: int) -> torch.Tensor:
        """``[batch, 1, seq, length]`` booleans: may query ``slot + i`` of row ``b`` see key
        slot ``j``? Causal (``j <= slot + i``) and not padding (``j >= pad[b]``). A padding
        query always sees itself: a query that sees nothing would give NaN in eager
        attention, and its NaN values would reach real queries through ``0 * NaN``. Padding
        shifts a row's positions and slots alike, so the window counts slots."""
        device = self.pad.device
        queries = (self.slot + torch.arange(seq, device=device))[:, None]
        keys = torch.arange(self.length, device=device)[None, :]
        causal = keys <= queries
        if self.window is not None:
            causal = causal & (keys > queries - self.window)
        real = keys[None] >= self.pad[:, None, None]
        return (causal[None] & (real | (keys == queries)[None]))[:, None]
