"""Mixtral hyper-parameters, the named configurations, and size/FLOP accounting.

A Mixtral is Llama's decoder (attention, norms, embeddings: :class:`LlamaConfig`'s fields)
with a mixture of experts in place of each MLP, so :class:`MixtralConfig` extends
:class:`LlamaConfig`. No torch is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..llama.config import LlamaConfig
from ..llama.config import flops_per_token as _llama_flops_per_token
from ..llama.config import param_shapes as _llama_param_shapes

__all__ = ["CONFIGS", "MOE_IMPLS", "MixtralConfig", "flops_per_token", "param_shapes"]

# How the experts' matmuls are computed (tpu_train.models.mixtral.moe): every expert on every
# token, weighted by the router (``dense``), or the tokens sorted by expert and one grouped
# matmul (``grouped``). The two compute the same outputs.
MOE_IMPLS = ("dense", "grouped")


@dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """A Mixtral decoder: Llama attention, and a mixture of ``n_experts`` SwiGLU experts of
    width ``ffn_hidden_dim`` in place of the MLP, ``top_k`` of them per token.

    ``router_aux_loss_coef`` weighs the load-balancing loss added to the training loss
    (Hugging Face's ``router_aux_loss_coef``); ``moe_impl`` picks the expert computation.
    Llama's Qwen2/Mistral options (``qkv_bias``, ``sliding_window``) are not part of it.
    """

    n_experts: int = 8
    top_k: int = 2
    router_aux_loss_coef: float = 0.02
    moe_impl: str = "dense"

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("n_experts", "top_k"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MixtralConfig.{field} must be a positive int, got {value!r}")
        if self.top_k > self.n_experts:
            raise ValueError(f"MixtralConfig.top_k ({self.top_k}) must be at most n_experts "
                             f"({self.n_experts})")
        if self.router_aux_loss_coef < 0:
            raise ValueError("MixtralConfig.router_aux_loss_coef must be >= 0, got "
                             f"{self.router_aux_loss_coef}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"MixtralConfig.moe_impl must be one of {', '.join(MOE_IMPLS)}, "
                             f"got {self.moe_impl!r}")

    def _check_family_options(self) -> None:
        if self.qkv_bias or self.sliding_window is not None or self.hf_model_type != "llama":
            raise ValueError(
                "MixtralConfig has no qkv_bias, sliding_window or hf_model_type options (got "
                f"qkv_bias={self.qkv_bias}, sliding_window={self.sliding_window}, "
                f"hf_model_type={self.hf_model_type!r}); leave them at their defaults")


CONFIGS: dict[str, MixtralConfig] = {
    # Tiny, for tests and CPU runs.
    "mixtral_tiny": MixtralConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden_dim=96,
        max_seq_len=256, n_experts=8, top_k=2,
    ),
    # Mixtral-8x7B's published shape (Hugging Face mistralai/Mixtral-8x7B-v0.1).
    "mixtral_8x7b": MixtralConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
        ffn_hidden_dim=14336, norm_eps=1e-5, rope_theta=1e6, max_seq_len=32768,
        n_experts=8, top_k=2, router_aux_loss_coef=0.02,
    ),
}


def param_shapes(cfg: MixtralConfig) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of ``Mixtral(cfg).named_parameters()``, in that order: Llama's, each
    layer's MLP replaced by the stacked experts ``feed_forward.w{1,2,3}`` ``[n_experts, out,
    in]`` and the router ``feed_forward.gate.weight`` ``[n_experts, dim]``."""
    e, f, d = cfg.n_experts, cfg.ffn_hidden_dim, cfg.dim
    shapes = {}
    for name, shape in _llama_param_shapes(cfg).items():
        if name.endswith(("feed_forward.w2.weight", "feed_forward.w3.weight")):
            continue
        if name.endswith("feed_forward.w1.weight"):
            p = name[:-len("w1.weight")]
            # A module's own parameters come before its submodules' (the router's).
            shapes.update({p + "w1": (e, f, d), p + "w2": (e, d, f), p + "w3": (e, f, d),
                           p + "gate.weight": (e, d)})
            continue
        shapes[name] = shape
    return shapes


def flops_per_token(cfg: MixtralConfig, seq_len: int) -> int:
    """Training FLOPs per token as Llama's (:func:`tpu_train.models.llama.flops_per_token`),
    counting the active parameters: the ``top_k`` experts a token is routed to and the router,
    not every expert."""
    mlp = 3 * cfg.dim * cfg.ffn_hidden_dim
    active = cfg.top_k * mlp + cfg.dim * cfg.n_experts
    return _llama_flops_per_token(cfg, seq_len) + 6 * cfg.n_layers * (active - mlp)
