"""Hugging Face ``MixtralForCausalLM`` checkpoints: config translation and tensor names.

Loading and saving are Llama's (:mod:`tpu_train.models.llama.hf`) with the names and config
translation here (:class:`MixtralTensorNames`). Attention, norms, embeddings and head are named as in Llama; each layer's mixture is
``block_sparse_moe.gate.weight`` (the router, ``[n_experts, dim]``) and
``block_sparse_moe.experts.E.w{1,2,3}.weight``, one ``nn.Linear`` weight per expert, which are
the slices ``E`` of our stacked ``feed_forward.w{1,2,3}``. transformers 5 keeps this layout
in the files it writes (it fuses the experts only in memory).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from ..llama.hf import CONFIG_FILE, TensorNames, from_pretrained as _llama_from_pretrained, \
    read_config as _llama_read_config, save_pretrained as _llama_save_pretrained
from ..llama.hf import config_from_hf as llama_config_from_hf
from ..llama.hf import config_to_hf as llama_config_to_hf
from .config import MixtralConfig
from .model import Mixtral

__all__ = ["MixtralTensorNames", "config_from_hf", "config_to_hf", "from_pretrained",
           "read_config", "save_pretrained"]

_MOE = "block_sparse_moe"
_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_GATE = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight")
_OURS = re.compile(r"layers\.(\d+)\.feed_forward\.(gate\.weight|w[123])")


def config_from_hf(hf: dict, *, source: str = CONFIG_FILE) -> MixtralConfig:
    """Translate a Hugging Face ``MixtralConfig`` dict (config.json): Llama's fields plus the
    experts. Sliding-window attention and router jitter are refused (not implemented here)."""
    architectures = hf.get("architectures") or []
    if architectures and "MixtralForCausalLM" not in architectures:
        raise ValueError(f"{source}: unsupported architectures {architectures} for "
                         "model_type 'mixtral'; expected MixtralForCausalLM")
    window = hf.get("sliding_window")
    if window is not None and window < int(hf.get("max_position_embeddings", 2048)):
        raise ValueError(f"{source}: sliding_window={window} (local attention) is not "
                         "implemented for Mixtral; only full causal attention")
    if hf.get("router_jitter_noise", 0.0):
        raise ValueError(f"{source}: router_jitter_noise={hf['router_jitter_noise']} is not "
                         "implemented; expected 0")
    llama = llama_config_from_hf({**hf, "model_type": "llama", "architectures": []},
                                 source=source)
    try:
        n_experts = int(hf["num_local_experts"])
        top_k = int(hf["num_experts_per_tok"])
    except KeyError as missing:
        raise ValueError(f"{source}: required field {missing} is missing") from None
    return MixtralConfig(**{f.name: getattr(llama, f.name) for f in dataclasses.fields(llama)},
                         n_experts=n_experts, top_k=top_k,
                         router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


def config_to_hf(cfg: MixtralConfig, **kwargs) -> dict:
    """A config.json dict for ``cfg`` that ``transformers.MixtralForCausalLM`` reads."""
    hf = llama_config_to_hf(cfg, **kwargs)
    for llama_only in ("mlp_bias", "rope_scaling"):
        hf.pop(llama_only)
    hf.update({
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    })
    return hf


class MixtralTensorNames(TensorNames):
    """Mixtral's names: Llama's, with the experts stored one tensor per expert."""

    model_class = Mixtral
    model_type = "mixtral"

    def locate(self, hf: str) -> tuple[str, int | None] | None:
        expert = _EXPERT.fullmatch(hf)
        if expert:
            layer, index, weight = expert.groups()
            return f"layers.{layer}.feed_forward.{weight}", int(index)
        gate = _GATE.fullmatch(hf)
        if gate:
            return f"layers.{gate.group(1)}.feed_forward.gate.weight", None
        if ".mlp." in hf:
            return None  # Llama's dense MLP names are not part of a Mixtral
        return super().locate(hf)

    def stored(self, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        ours = _OURS.fullmatch(name)
        if ours is None:
            return super().stored(name, value)
        layer, what = ours.groups()
        prefix = f"model.layers.{layer}.{_MOE}"
        if what == "gate.weight":
            return [(f"{prefix}.gate.weight", value)]
        return [(f"{prefix}.experts.{e}.{what}.weight", value[e]) for e in range(value.shape[0])]

    def config_to_hf(self, cfg, **kwargs) -> dict:
        return config_to_hf(cfg, **kwargs)

    def config_from_hf(self, hf: dict, *, source: str) -> MixtralConfig:
        return config_from_hf(hf, source=source)


def read_config(path) -> tuple[dict, MixtralConfig]:
    """(config.json's dict, its :class:`MixtralConfig`) of a Hugging Face Mixtral directory."""
    return _llama_read_config(path, MixtralTensorNames())


def from_pretrained(path, dtype=None, device=None, *, max_seq_len=None) -> Mixtral:
    """Load a Hugging Face Mixtral directory (as :func:`tpu_train.models.llama.from_pretrained`)."""
    return _llama_from_pretrained(path, dtype, device, max_seq_len=max_seq_len,
                                  names=MixtralTensorNames())


def save_pretrained(model: Mixtral, path, **options) -> None:
    """Write ``model`` as a ``MixtralForCausalLM`` directory (options as
    :func:`tpu_train.models.llama.save_pretrained`)."""
    _llama_save_pretrained(model, path, names=MixtralTensorNames(), **options)
