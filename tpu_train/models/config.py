"""Llama hyper-parameters, the named published configurations, and size/FLOP accounting."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = [
    "CONFIGS",
    "LlamaConfig",
    "RopeScaling",
    "flops_per_token",
    "get_config",
    "num_params",
]


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style RoPE frequency scaling (Hugging Face ``rope_type: "llama3"``).

    Low frequencies (long wavelengths) are divided by ``factor``, high frequencies are kept,
    and the band between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "RopeScaling.high_freq_factor must be greater than low_freq_factor, got "
                f"high_freq_factor={self.high_freq_factor}, low_freq_factor={self.low_freq_factor}"
            )
        if self.original_max_seq_len <= 0:
            raise ValueError(
                f"RopeScaling.original_max_seq_len must be > 0, got {self.original_max_seq_len}"
            )


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama 2 / 3 / 3.1 / 3.2 decoder.

    ``max_seq_len`` bounds the positions the model can see (it sizes the RoPE tables); recipes
    may lower it to the training sequence length with ``dataclasses.replace``.
    ``head_dim`` is always ``dim // n_heads``.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                      "ffn_hidden_dim", "max_seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{field} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"LlamaConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim // n_heads = {self.head_dim} must be even for rotary embeddings"
            )
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"LlamaConfig.norm_eps and rope_theta must be > 0, got norm_eps={self.norm_eps}, "
                f"rope_theta={self.rope_theta}"
            )
        if isinstance(self.rope_scaling, dict):
            # Hydra/OmegaConf hand nested configs over as plain mappings.
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


_LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_seq_len=8192)
_LLAMA32_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_seq_len=8192)

CONFIGS: dict[str, LlamaConfig] = {
    # Small enough to train on a laptop CPU; the default of the CPU recipes.
    "debug_tiny": LlamaConfig(
        dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden_dim=768,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=256, tie_embeddings=False,
    ),
    # Long sequences at a test's cost: context parallelism at 4,096 tokens on the CPU client.
    "debug_tiny_long": LlamaConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden_dim=192,
        norm_eps=1e-5, rope_theta=10000.0, max_seq_len=8192, tie_embeddings=False,
    ),
    # The sizes scripts/bench_train_step.py --size benchmarks (scripts/jax_llama.py SIZES), at
    # the sequence length they are benchmarked at: configs/model/llama_{w1,350m,1b}.yaml train
    # them from random initialization at the benchmark's batch.
    "llama_w1": LlamaConfig(
        dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_hidden_dim=1408,
        max_seq_len=256,
    ),
    "llama_350m": LlamaConfig(
        dim=1024, n_layers=16, n_heads=16, n_kv_heads=8, vocab_size=32000, ffn_hidden_dim=2816,
        max_seq_len=1024,
    ),
    "llama_1b": LlamaConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_hidden_dim=5632,
        max_seq_len=2048,
    ),
    "llama2_7b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
        ffn_hidden_dim=11008, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096,
    ),
    "llama3_2_1b": LlamaConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
        ffn_hidden_dim=8192, norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA32_ROPE,
        max_seq_len=131072, tie_embeddings=True,
    ),
    "llama3_2_3b": LlamaConfig(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
        ffn_hidden_dim=8192, norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA32_ROPE,
        max_seq_len=131072, tie_embeddings=True,
    ),
    "llama3_1_8b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
        ffn_hidden_dim=14336, norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE,
        max_seq_len=131072,
    ),
    "llama3_1_70b": LlamaConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
        ffn_hidden_dim=28672, norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE,
        max_seq_len=131072,
    ),
}


def get_config(name: str, **overrides) -> LlamaConfig:
    """Return the named configuration, optionally with some fields replaced.

    >>> get_config("llama3_1_8b", max_seq_len=8192).max_seq_len
    8192
    """
    if name not in CONFIGS:
        raise KeyError(
            f"unknown Llama config {name!r}; valid names are: {', '.join(sorted(CONFIGS))}"
        )
    config = CONFIGS[name]
    if overrides:
        valid = {f.name for f in dataclasses.fields(LlamaConfig)}
        unknown = sorted(set(overrides) - valid)
        if unknown:
            raise TypeError(
                f"unknown LlamaConfig field(s) {unknown}; valid fields are: {', '.join(sorted(valid))}"
            )
        config = dataclasses.replace(config, **overrides)
    return config


def _layer_matmul_params(cfg: LlamaConfig) -> int:
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    attention = cfg.dim * cfg.dim * 2 + cfg.dim * kv_dim * 2  # wq, wo, wk, wv
    mlp = 3 * cfg.dim * cfg.ffn_hidden_dim  # w1, w2, w3
    return attention + mlp


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of ``Llama(cfg).named_parameters()``, in that order and layout
    (``[out, in]`` weights; no ``output.weight`` when embeddings are tied), without building
    the model."""
    kv = cfg.n_kv_heads * cfg.head_dim
    q = cfg.n_heads * cfg.head_dim
    shapes = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim)}
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attention_norm.weight": (cfg.dim,),
            p + "attention.wq.weight": (q, cfg.dim),
            p + "attention.wk.weight": (kv, cfg.dim),
            p + "attention.wv.weight": (kv, cfg.dim),
            p + "attention.wo.weight": (cfg.dim, q),
            p + "ffn_norm.weight": (cfg.dim,),
            p + "feed_forward.w1.weight": (cfg.ffn_hidden_dim, cfg.dim),
            p + "feed_forward.w2.weight": (cfg.dim, cfg.ffn_hidden_dim),
            p + "feed_forward.w3.weight": (cfg.ffn_hidden_dim, cfg.dim),
        })
    shapes["norm.weight"] = (cfg.dim,)
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, cfg.dim)
    return shapes


def num_params(cfg: LlamaConfig) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    per_layer = _layer_matmul_params(cfg) + 2 * cfg.dim  # plus two RMSNorm weights
    embedding = cfg.vocab_size * cfg.dim
    output = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return cfg.n_layers * per_layer + embedding + output + cfg.dim  # final norm


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, for MFU.

    ``6 * N_matmul + 12 * n_layers * dim * seq_len``: ``N_matmul`` counts the weights that take
    part in a matmul (every linear layer and the output head, tied or not; the embedding lookup
    and norms are not matmuls), and the second term is the attention score and value products,
    counted over the full ``seq_len x seq_len`` square as is customary (causal masking is not
    subtracted), so MFU figures compare with published ones.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    matmul_params = cfg.n_layers * _layer_matmul_params(cfg) + cfg.vocab_size * cfg.dim
    return 6 * matmul_params + 12 * cfg.n_layers * cfg.dim * seq_len
