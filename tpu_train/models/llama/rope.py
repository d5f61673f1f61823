"""Rotary position embeddings in the Hugging Face "rotate half" layout.

Hugging Face Llama checkpoints store q/k projection rows permuted so that the two members of
each rotated pair sit ``head_dim // 2`` apart (rather than adjacent, as in Meta's original
code). Rotating in that layout lets HF weights load without any permutation.
"""

from __future__ import annotations

import math

import torch

from .config import LlamaConfig, RopeScaling

__all__ = ["apply_rotary", "inverse_frequencies", "rope_tables"]


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: RopeScaling | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies (float32, CPU), with optional Llama-3 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (beyond the original context) are stretched by `factor`; short ones are
    # kept; the band in between blends the two linearly in 1/wavelength.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_seq_len / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def rope_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``[max_seq_len, head_dim // 2]``, float32 on the CPU.

    Computed in float32 on the CPU so that every device (and the HF reference) sees the same
    angles; a model cast to bf16 then holds exactly HF's bf16-rounded cos/sin.
    """
    inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    positions = torch.arange(cfg.max_seq_len, dtype=torch.int64, device="cpu").to(torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[..., seq, head_dim]`` by the angles of ``cos``/``sin``
    (``[seq, head_dim // 2]``), pairing element ``i`` with ``i + head_dim // 2``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
