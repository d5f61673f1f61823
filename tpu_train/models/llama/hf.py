"""Hugging Face Llama, Qwen2 and Mistral checkpoints: config translation, loading and saving
safetensors.

The three share one layout of weights (``LlamaForCausalLM``'s names); Qwen2 adds the q/k/v
projection biases and Mistral a sliding attention window, which :class:`LlamaConfig` holds as
``qkv_bias`` and ``sliding_window``; ``hf_model_type`` says which architecture to write back.

Loading builds the model on the meta device, allocates it once on the target device and dtype,
then copies the checkpoint in tensor by tensor, so at most one checkpoint tensor is held on
the CPU besides the model (:func:`read_weights` streams them to a caller that stores each
its own way: an int8 base quantizes them as they come). Saving goes shard by shard for the same reason.

A family built on this decoder whose checkpoints name tensors differently (Mixtral) passes
its own :class:`TensorNames` to :func:`read_config`, :func:`from_pretrained` and
:func:`save_pretrained`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import LlamaConfig, RopeScaling
from .model import Llama

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "hf_name",
    "read_config",
    "read_weights",
    "save_pretrained",
    "TensorNames",
]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Hugging Face's default shard size ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

# Our name -> HF name, per layer.
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_HF_TOP_NAMES = {v: k for k, v in _TOP_NAMES.items()}
_SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Present in some older exports; derived from the config, so safe to skip.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
# model_type -> its causal-LM class, the ``architectures`` entry of config.json.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "mistral": "MistralForCausalLM"}


def hf_name(name: str) -> str:
    """The Hugging Face name (``LlamaForCausalLM``'s, which Qwen2 and Mistral share) of one of
    our parameter names."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def _our_name(hf: str) -> str | None:
    if hf in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[hf]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    if match and match.group(2) in _HF_LAYER_NAMES:
        return f"layers.{match.group(1)}.{_HF_LAYER_NAMES[match.group(2)]}"
    return None


class TensorNames:
    """How a family's parameters and config are stored in Hugging Face files: Llama's one
    tensor per parameter; a family built on this decoder that splits a parameter over several
    tensors (Mixtral's experts) overrides the methods, and hands its instance to
    :func:`read_config`, :func:`from_pretrained` and :func:`save_pretrained`."""

    model_class = Llama
    # The model_type in error messages (None: the config's ``hf_model_type``).
    model_type: str | None = None

    def locate(self, hf: str) -> tuple[str, int | None] | None:
        """``(our parameter name, index along its first dimension or None)`` of HF tensor
        ``hf``, or None if the family has no such tensor."""
        ours = _our_name(hf)
        return None if ours is None else (ours, None)

    def stored(self, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``[(hf name, tensor)]`` holding parameter ``name`` (value ``value``)."""
        return [(hf_name(name), value)]

    def config_to_hf(self, cfg, **kwargs) -> dict:
        return config_to_hf(cfg, **kwargs)

    def config_from_hf(self, hf: dict, *, source: str) -> LlamaConfig:
        return config_from_hf(hf, source=source)


# ---------------------------------------------------------------------------------------------
# Config translation


def _rope_from_hf(hf: dict, source: str) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes "rope_parameters" (theta included); older files write
    # "rope_theta" plus an optional "rope_scaling" whose type key is "rope_type" or "type".
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(
            f"{source}: unsupported RoPE scaling type {rope_type!r}; only 'default' and "
            "'llama3' are implemented"
        )
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_seq_len=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise ValueError(f"{source}: llama3 rope scaling lacks the field {missing}") from None


def _family_options(hf: dict, model_type: str, source: str) -> dict:
    """The :class:`LlamaConfig` fields that set the family's options, from its config.json."""
    if model_type == "llama":
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag, False):
                raise ValueError(f"{source}: {flag}=true is not supported by this Llama")
        return {}
    if model_type == "qwen2":
        sliding = hf.get("use_sliding_window", False) or "sliding_attention" in (
            hf.get("layer_types") or ())
        if sliding:
            raise ValueError(f"{source}: Qwen2 with use_sliding_window=true (a window on some "
                             "layers only) is not supported; Qwen2.5 checkpoints set it false")
        return {"qkv_bias": True, "hf_model_type": "qwen2"}
    window = hf.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ValueError(f"{source}: sliding_window must be a positive integer or null, got "
                         f"{window!r}")
    return {"sliding_window": window, "hf_model_type": "mistral"}


def config_from_hf(hf: dict, *, source: str = CONFIG_FILE) -> LlamaConfig:
    """Translate a Hugging Face ``LlamaConfig``, ``Qwen2Config`` or ``MistralConfig`` dict (the
    contents of config.json).

    ``source`` names the file in error messages. Raises ``ValueError`` for architectures or
    options this model does not implement (Llama biases, a non-SiLU activation, a head_dim
    other than hidden_size / num_attention_heads, RoPE scaling other than llama3, Qwen2's
    per-layer sliding windows).
    """
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type not in _ARCHITECTURES or (
            architectures and _ARCHITECTURES[model_type] not in architectures):
        known = ", ".join(f"{t!r} ({c})" for t, c in _ARCHITECTURES.items())
        raise ValueError(
            f"{source}: unsupported architecture (model_type={model_type!r}, "
            f"architectures={architectures}); the checkpoints that can be loaded are "
            f"model_type {known}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: unsupported hidden_act {hf['hidden_act']!r}; expected 'silu'")
    options = _family_options(hf, model_type, source)
    try:
        dim = int(hf["hidden_size"])
        n_heads = int(hf["num_attention_heads"])
        fields = dict(
            dim=dim,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            vocab_size=int(hf["vocab_size"]),
            ffn_hidden_dim=int(hf["intermediate_size"]),
        )
    except KeyError as missing:
        raise ValueError(f"{source}: required field {missing} is missing") from None
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * n_heads != dim:
        raise ValueError(
            f"{source}: head_dim={head_dim} differs from hidden_size / num_attention_heads = "
            f"{dim // n_heads}; decoupled head sizes are not supported"
        )
    theta, scaling = _rope_from_hf(hf, source)
    return LlamaConfig(
        **fields,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **options,
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config(path: str | Path, names: TensorNames | None = None) -> tuple[dict, LlamaConfig]:
    """(the raw config.json dict, its :class:`LlamaConfig`) of a Hugging Face directory
    (``names``: another family's translation, e.g. Mixtral's).

    Raises ``FileNotFoundError``/``ValueError`` with a one-line message naming the file: no
    config.json, unreadable JSON, another architecture (its ``architectures``), a missing
    field or an unsupported option.
    """
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{config_path} not found: expected a Hugging Face Llama, Qwen2 or Mistral "
            "directory containing config.json and safetensors weights"
        )
    hf = _read_json(config_path)
    try:
        cfg = (names or TensorNames()).config_from_hf(hf, source=str(config_path))
    except (TypeError, ValueError) as err:
        if str(err).startswith(str(config_path)):
            raise
        raise ValueError(f"{config_path}: {err}") from None
    return hf, cfg


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_to_hf(cfg: LlamaConfig, *, dtype: torch.dtype = torch.float32,
                 bos_token_id: int | None = None,
                 eos_token_id: int | list[int] | None = None) -> dict:
    """A Hugging Face config.json dict for ``cfg``, of its ``hf_model_type`` (readable by
    transformers 4.x and 5.x)."""
    rope_scaling = None
    if cfg.rope_scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling.factor,
            "low_freq_factor": cfg.rope_scaling.low_freq_factor,
            "high_freq_factor": cfg.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling.original_max_seq_len,
        }
    hf = {
        "architectures": [_ARCHITECTURES[cfg.hf_model_type]],
        "model_type": cfg.hf_model_type,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        **_family_fields(cfg),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": _dtype_name(dtype),
        "dtype": _dtype_name(dtype),
    }
    if bos_token_id is not None:
        hf["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
        hf["eos_token_id"] = eos_token_id
    return hf


def _family_fields(cfg: LlamaConfig) -> dict:
    if cfg.hf_model_type == "qwen2":
        return {"use_sliding_window": False, "sliding_window": None,
                "max_window_layers": cfg.n_layers}
    if cfg.hf_model_type == "mistral":
        return {"sliding_window": cfg.sliding_window}
    return {"attention_bias": False, "mlp_bias": False}


# ---------------------------------------------------------------------------------------------
# Loading


def _weight_locations(directory: Path) -> tuple[dict[str, Path] | None, list[Path], Path]:
    """``(hf name -> file or None if unknown, files to read, file to blame for a missing name)``."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ValueError(f"{index}: not a valid safetensors index ({err})") from None
        files = sorted({directory / f for f in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{index} lists shard {file.name}, but {file} is missing")
        return {name: directory / f for name, f in weight_map.items()}, files, index
    single = directory / SINGLE_WEIGHTS_FILE
    if single.is_file():
        return None, [single], single
    legacy = sorted(p.name for p in directory.glob("*.bin")) + sorted(
        p.name for p in directory.glob("*.pth"))
    hint = (f" (found {', '.join(legacy)}: re-save it with safe_serialization=True)"
            if legacy else "")
    raise FileNotFoundError(
        f"no safetensors weights in {directory}: expected {SINGLE_WEIGHTS_FILE} or "
        f"{INDEX_FILE} with its shards{hint}"
    )


def _dtype_from_hf(hf: dict, source: Path) -> torch.dtype:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{source}: unrecognised dtype {name!r}; pass dtype= explicitly")
    return dtype


def _file_tensors(file: Path, params: dict, loaded: set, cfg: LlamaConfig,
                  config_path: Path, names: TensorNames):
    """The tensors of one safetensors file as ``(parameter name, index or None, tensor)``,
    each checked by name, shape and finiteness before it is yielded, its name recorded in
    ``loaded``."""
    with safe_open(str(file), framework="pt", device="cpu") as reader:
        for hf_key in reader.keys():
            located = names.locate(hf_key)
            if located is None:
                if hf_key.endswith(_IGNORED_HF_SUFFIXES):
                    continue
                raise ValueError(
                    f"{file}: unexpected tensor {hf_key!r}, not part of a "
                    f"{names.model_type or cfg.hf_model_type} model with this config.json"
                )
            ours, index = located
            if ours == "output.weight" and cfg.tie_embeddings:
                continue  # some tied exports store the shared matrix twice
            if ours not in params or (index is not None and index >= params[ours].shape[0]):
                raise ValueError(
                    f"{file}: tensor {hf_key!r} does not fit the config in {config_path} "
                    f"(num_hidden_layers={cfg.n_layers}, "
                    f"tie_word_embeddings={cfg.tie_embeddings})"
                )
            expected = params[ours].shape if index is None else params[ours].shape[1:]
            shape = tuple(reader.get_slice(hf_key).get_shape())
            if shape != tuple(expected):
                raise ValueError(
                    f"{file}: tensor {hf_key!r} has shape {list(shape)} but the config in "
                    f"{config_path} requires {list(expected)}"
                )
            tensor = reader.get_tensor(hf_key)
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{file}: tensor {hf_key!r} holds NaN or inf values")
            loaded.add(hf_key)
            yield ours, index, tensor


def read_weights(path: str | Path, params: dict, *, names: TensorNames | None = None):
    """The weights of a Hugging Face directory, one tensor at a time as it is read: ``(our
    parameter name, index along its first dimension or None, CPU tensor in the file's
    dtype)``, checked against ``params`` (our name -> a tensor of the expected shape, e.g. a
    ``meta`` model's parameters). Raises the errors of :func:`from_pretrained` (a tensor
    ``params`` lacks or of another shape, NaN or inf values, a damaged file, and at the end a
    tensor missing)."""
    directory = Path(path)
    names = names or TensorNames()
    _, cfg = read_config(directory, names)
    weight_map, files, blame = _weight_locations(directory)
    loaded: set[str] = set()
    for file in files:
        try:
            yield from _file_tensors(file, params, loaded, cfg, directory / CONFIG_FILE, names)
        except SafetensorError as err:
            raise ValueError(f"{file}: not a readable safetensors file ({err}): it is truncated "
                             "or damaged; copy or download it again") from None
    missing = [key for n, p in params.items() for key, _ in names.stored(n, p)
               if key not in loaded]
    if missing:
        where = blame
        if weight_map is not None and missing[0] in weight_map:
            where = weight_map[missing[0]]
        raise ValueError(
            f"{where}: missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )


@torch.no_grad()
def from_pretrained(path: str | Path, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, *,
                    max_seq_len: int | None = None, names: TensorNames | None = None) -> Llama:
    """Load a Hugging Face Llama, Qwen2 or Mistral directory (config.json + safetensors,
    single or sharded).

    ``dtype`` defaults to the dtype recorded in config.json (float32 if absent); ``device``
    defaults to the CPU; ``device="meta"`` gives the model without its weights (nothing is
    read but the configs: :func:`read_weights` then streams them). ``max_seq_len`` replaces
    the checkpoint's max_position_embeddings (131072 for Llama 3.1), which only sizes the RoPE
    tables, with the length actually used. Raises ``FileNotFoundError``/``ValueError`` naming
    the file (and tensor) at fault for a missing config or weights, a missing or unexpected
    tensor, a shape mismatch, or an unsupported architecture.
    """
    directory = Path(path)
    config_path = directory / CONFIG_FILE
    names = names or TensorNames()
    hf, cfg = read_config(directory, names)
    if max_seq_len is not None:
        cfg = dataclasses.replace(cfg, max_seq_len=max_seq_len)
    dtype = dtype if dtype is not None else _dtype_from_hf(hf, config_path)
    _weight_locations(directory)  # no weights at all: the same error with device="meta"

    with torch.device("meta"):
        model = names.model_class(cfg)
    model.to(dtype=dtype)
    # Kept so that save_pretrained of a fine-tuned model writes the same special tokens.
    model.hf_special_tokens = {k: hf[k] for k in _SPECIAL_TOKEN_KEYS if hf.get(k) is not None}
    generation = directory / GENERATION_CONFIG_FILE
    model.hf_generation_config = _read_json(generation) if generation.is_file() else None
    if device is not None and torch.device(device).type == "meta":
        return model
    model.to_empty(device=device if device is not None else "cpu")
    params = dict(model.named_parameters())
    for ours, index, tensor in read_weights(directory, params, names=names):
        (params[ours] if index is None else params[ours][index]).copy_(tensor)
    model.reset_rope_tables()
    return model


# ---------------------------------------------------------------------------------------------
# Saving


def _plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes:
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def _generation_config(inherited: dict | None, bos_token_id, eos_token_id, pad_token_id) -> dict:
    """generation_config.json: the loaded checkpoint's (sampling settings kept) with our ids."""
    generation = dict(inherited) if inherited else {"_from_model_config": True}
    if bos_token_id is not None:
        generation["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
        stops = generation.get("eos_token_id")
        stops = stops if isinstance(stops, list) else [stops]
        # A checkpoint that stops on several ids (Llama 3 instruct) keeps them all.
        wanted = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        if not set(wanted) <= set(stops):
            generation["eos_token_id"] = eos_token_id
    if pad_token_id is not None:
        generation["pad_token_id"] = pad_token_id
    return generation


@torch.no_grad()
def save_pretrained(model: Llama, path: str | Path,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, *,
                    bos_token_id: int | None = None,
                    eos_token_id: int | list[int] | None = None,
                    pad_token_id: int | None = None,
                    state_dict: dict | None = None, names: TensorNames | None = None) -> None:
    """Write ``model`` as a Hugging Face directory of its config's ``hf_model_type``, loadable
    by ``transformers.AutoModelForCausalLM.from_pretrained`` (and by :func:`from_pretrained`).

    Writes config.json, generation_config.json and ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json`` when the
    weights exceed ``max_shard_bytes``. Weight files left by an earlier save in ``path`` are
    removed first so that a stale index or shard cannot shadow the new one. Parameters may
    live on any device; each shard is gathered to the CPU in turn. ``bos_token_id``,
    ``eos_token_id`` and ``pad_token_id`` default to those of the checkpoint the model was
    loaded from, if any; so does generation_config.json (its sampling settings are kept, and
    its list of stop ids when it already holds ``eos_token_id``).
    ``state_dict`` (whole CPU tensors by parameter name) replaces the parameters' values, for a
    model whose parameters are sharded over devices this process cannot read.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.iterdir():
        if stale.name in (SINGLE_WEIGHTS_FILE, INDEX_FILE) or _SHARD_PATTERN.fullmatch(stale.name):
            stale.unlink()

    inherited = getattr(model, "hf_special_tokens", {})
    bos_token_id = bos_token_id if bos_token_id is not None else inherited.get("bos_token_id")
    stops = inherited.get("eos_token_id")
    if eos_token_id is None or (isinstance(stops, list) and isinstance(eos_token_id, int)
                                and eos_token_id in stops):
        eos_token_id = stops  # a checkpoint that stops on several ids keeps them all
    pad_token_id = pad_token_id if pad_token_id is not None else inherited.get("pad_token_id")
    params = dict(model.named_parameters())
    if state_dict is not None:
        params = {name: state_dict[name] for name in params}
    dtype = model.tok_embeddings.weight.dtype
    names = names or TensorNames()
    params = dict(pair for n, p in params.items() for pair in names.stored(n, p))
    hf_config = names.config_to_hf(model.config, dtype=dtype, bos_token_id=bos_token_id,
                             eos_token_id=eos_token_id)
    if pad_token_id is not None:
        hf_config["pad_token_id"] = pad_token_id
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = _generation_config(getattr(model, "hf_generation_config", None),
                                    bos_token_id, eos_token_id, pad_token_id)
    (directory / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")

    sizes = [(name, p.numel() * p.element_size()) for name, p in params.items()]
    shards = _plan_shards(sizes, max_shard_bytes)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        tensors = {n: params[n].detach().to("cpu").contiguous() for n in shards[0]}
        save_file(tensors, str(directory / SINGLE_WEIGHTS_FILE), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: params[n].detach().to("cpu").contiguous() for n in shard}
        save_file(tensors, str(directory / file_name), metadata=metadata)
        weight_map.update({key: file_name for key in tensors})
        del tensors
    index = {"metadata": {"total_size": sum(size for _, size in sizes)}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
