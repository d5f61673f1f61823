"""Llama hyper-parameters, the named published configurations, and size/FLOP accounting."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = [
    "CONFIGS",
    "HF_MODEL_TYPES",
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


# The Hugging Face architectures a config can be written as, and what each one's decoder has
# beyond Llama's: q/k/v projection biases (Qwen2), a sliding attention window (Mistral).
HF_MODEL_TYPES = ("llama", "qwen2", "mistral")
_ALLOWS_QKV_BIAS = ("qwen2",)
_ALLOWS_SLIDING_WINDOW = ("mistral",)


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style decoder: Llama 2 / 3 / 3.1 / 3.2, Qwen2 / Qwen2.5, Mistral.

    ``max_seq_len`` bounds the positions the model can see (it sizes the RoPE tables); recipes
    may lower it to the training sequence length with ``dataclasses.replace``.
    ``head_dim`` is always ``dim // n_heads``.

    The other families are options of the same decoder: ``qkv_bias`` gives the q/k/v
    projections a bias (Qwen2), ``sliding_window`` lets a token attend only to itself and the
    ``sliding_window - 1`` tokens before it (Mistral; ``None``: the whole causal prefix).
    ``hf_model_type`` is the Hugging Face ``model_type`` the weights are exported as; a config
    must be expressible in it (Llama has neither option, Mistral no bias, Qwen2 no window), so
    a run fails at its start rather than at its export.
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
    qkv_bias: bool = False
    sliding_window: int | None = None
    hf_model_type: str = "llama"

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
        self._check_family_options()
        if isinstance(self.rope_scaling, dict):
            # Hydra/OmegaConf hand nested configs over as plain mappings.
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    def _check_family_options(self) -> None:
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                                   or window <= 0):
            raise ValueError(f"LlamaConfig.sliding_window must be a positive int or None, got "
                             f"{window!r}")
        if self.hf_model_type not in HF_MODEL_TYPES:
            raise ValueError(f"LlamaConfig.hf_model_type must be one of "
                             f"{', '.join(HF_MODEL_TYPES)}, got {self.hf_model_type!r}")
        if self.qkv_bias and self.hf_model_type not in _ALLOWS_QKV_BIAS:
            raise ValueError(f"LlamaConfig.qkv_bias=True cannot be written as a Hugging Face "
                             f"{self.hf_model_type!r} model; set hf_model_type='qwen2'")
        if window is not None and self.hf_model_type not in _ALLOWS_SLIDING_WINDOW:
            raise ValueError(f"LlamaConfig.sliding_window={window} cannot be written as a Hugging "
                             f"Face {self.hf_model_type!r} model; set hf_model_type='mistral'")

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
    # Qwen2.5 (Hugging Face Qwen/Qwen2.5-*): q/k/v biases, RoPE base 1e6, tied embeddings at
    # the small sizes. max_seq_len is max_position_embeddings (32768).
    "qwen2_5_0_5b": LlamaConfig(
        dim=896, n_layers=24, n_heads=14, n_kv_heads=2, vocab_size=151936,
        ffn_hidden_dim=4864, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768,
        tie_embeddings=True, qkv_bias=True, hf_model_type="qwen2",
    ),
    "qwen2_5_1_5b": LlamaConfig(
        dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, vocab_size=151936,
        ffn_hidden_dim=8960, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768,
        tie_embeddings=True, qkv_bias=True, hf_model_type="qwen2",
    ),
    "qwen2_5_7b": LlamaConfig(
        dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064,
        ffn_hidden_dim=18944, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768,
        qkv_bias=True, hf_model_type="qwen2",
    ),
    # Mistral 7B v0.1 (Hugging Face mistralai/Mistral-7B-v0.1): a 4096-token sliding window.
    "mistral_7b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
        ffn_hidden_dim=14336, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=32768,
        sliding_window=4096, hf_model_type="mistral",
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


def _layer_bias_params(cfg: LlamaConfig) -> int:
    return (cfg.dim + 2 * cfg.n_kv_heads * cfg.head_dim) if cfg.qkv_bias else 0


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
        shapes[p + "attention_norm.weight"] = (cfg.dim,)
        for name, rows in (("wq", q), ("wk", kv), ("wv", kv)):
            shapes[p + f"attention.{name}.weight"] = (rows, cfg.dim)
            if cfg.qkv_bias:
                shapes[p + f"attention.{name}.bias"] = (rows,)
        shapes.update({
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
    # Plus two RMSNorm weights and the q/k/v biases, if any.
    per_layer = _layer_matmul_params(cfg) + 2 * cfg.dim + _layer_bias_params(cfg)
    embedding = cfg.vocab_size * cfg.dim
    output = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return cfg.n_layers * per_layer + embedding + output + cfg.dim  # final norm


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, for MFU.

    ``6 * N_matmul + 12 * n_layers * dim * seq_len``: ``N_matmul`` counts the weights that take
    part in a matmul (every linear layer and the output head, tied or not; the embedding lookup,
    norms and q/k/v biases are not matmuls), and the second term is the attention score and
    value products, counted over the full ``seq_len x seq_len`` square as is customary (causal
    masking and a sliding window are not subtracted), so MFU figures compare with published
    ones.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    matmul_params = cfg.n_layers * _layer_matmul_params(cfg) + cfg.vocab_size * cfg.dim
    return 6 * matmul_params + 12 * cfg.n_layers * cfg.dim * seq_len
