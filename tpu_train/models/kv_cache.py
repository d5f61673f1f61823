"""Key/value cache for incremental decoding."""

from __future__ import annotations

import torch
from torch import nn

from .config import LlamaConfig

__all__ = ["KVCache"]


class KVCache:
    """Pre-allocated per-layer keys and values, ``[batch, n_kv_heads, max_seq_len, head_dim]``.

    Keys are stored after RoPE, so a cached position never needs re-rotating. The caller
    passes ``start_pos`` to each forward; the cache itself does not track a cursor, so one
    cache can be rewound by simply decoding from an earlier position again.
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
        shape = (batch_size, cfg.n_kv_heads, max_seq_len, cfg.head_dim)
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
        return everything cached for this layer up to the end of the new block."""
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
        self.keys[layer][:, :, start_pos:end].copy_(keys)
        self.values[layer][:, :, start_pos:end].copy_(values)
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
