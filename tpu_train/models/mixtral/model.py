"""The Mixtral decoder: Llama's attention and norms, a mixture of experts in place of the MLP.

Module names follow :mod:`tpu_train.models.llama.model`, with ``layers.N.feed_forward`` a
:class:`~.moe.MoEFeedForward` (``gate.weight``, stacked ``w1``/``w2``/``w3``). The forward
returns the logits, and with ``return_aux_loss=True`` also the load-balancing loss over every
layer's routing (:func:`~.moe.load_balancing_loss`), which a training loss adds weighted by
``config.router_aux_loss_coef`` (:attr:`Mixtral.aux_loss_weight`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..llama.kv_cache import KVCache
from ..llama.model import Llama, TransformerBlock
from .config import MixtralConfig
from .moe import MoEFeedForward, load_balancing_loss

__all__ = ["Mixtral", "MixtralBlock"]


class MixtralBlock(TransformerBlock):
    """Pre-norm attention + pre-norm mixture of experts; returns ``(h, router_logits)``."""

    def __init__(self, cfg: MixtralConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        self.feed_forward = MoEFeedForward(cfg.dim, cfg.ffn_hidden_dim, cfg.n_experts,
                                           cfg.top_k, cfg.moe_impl)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                start_pos: int = 0, cache: KVCache | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        extra = () if mask is None else (mask,)
        h = x + self.attention(self.attention_norm(x), cos, sin, start_pos, cache, *extra)
        out, router_logits = self.feed_forward(self.ffn_norm(h))
        return h + out, router_logits


class Mixtral(Llama):
    """Mixtral (``MixtralForCausalLM``) decoder-only language model; built and initialised
    like :class:`~tpu_train.models.llama.Llama` (:func:`~tpu_train.models.llama.init_weights`: the experts' weights are
    N(0, 0.02), ``w2`` scaled down with depth like Llama's)."""

    block_class = MixtralBlock

    def __init__(self, config: MixtralConfig):
        if not isinstance(config, MixtralConfig):
            raise TypeError(f"Mixtral needs a MixtralConfig, got {type(config).__name__}")
        super().__init__(config)

    def use_moe_impl(self, impl: str) -> "Mixtral":
        """Compute the experts in form ``impl`` (``dense`` or ``grouped``) from now on."""
        self.config = dataclasses.replace(self.config, moe_impl=impl)  # checks the name
        for layer in self.layers:
            layer.feed_forward.impl = impl
        return self

    @property
    def aux_loss_weight(self) -> float:
        """The weight of the load-balancing loss in the training loss."""
        return self.config.router_aux_loss_coef

    def forward(self, tokens: torch.Tensor, *, start_pos: int = 0,
                cache: KVCache | None = None, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, return_aux_loss: bool = False):
        """Logits as :meth:`Llama.forward`; with ``return_aux_loss``, ``(logits, aux_loss)``."""
        h, router_logits = self._final_and_router_logits(tokens, start_pos, cache, position_ids,
                                                         segment_ids)
        out = F.linear(h, self.tok_embeddings.weight) if self.output is None else self.output(h)
        if not return_aux_loss:
            return out
        return out, load_balancing_loss(router_logits, self.config.n_experts, self.config.top_k)

    def hidden_states(self, tokens: torch.Tensor, *, start_pos: int = 0,
                      cache: KVCache | None = None, position_ids: torch.Tensor | None = None,
                      segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output, as :meth:`Llama.hidden_states` (the router's logits, which
        only the load-balancing loss needs, are dropped)."""
        return self._final_and_router_logits(tokens, start_pos, cache, position_ids,
                                             segment_ids)[0]

    def _final_and_router_logits(self, tokens, start_pos, cache, position_ids, segment_ids):
        h, cos, sin, extra = self.prepare_inputs(tokens, start_pos, cache, position_ids, segment_ids)
        router_logits = []
        for layer in self.layers:
            h, logits = layer(h, cos, sin, start_pos, cache, *extra)
            router_logits.append(logits)
        return self.norm(h), router_logits
