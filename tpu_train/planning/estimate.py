"""The analytic plan: per-chip memory, FLOPs and step time of a training configuration.

:func:`estimate` is instantaneous, for any model size: the bytes each chip holds for
parameters, gradients, AdamW's two moments and activations (with or without
activation checkpointing) under the shardings of the model family's plan, the FLOPs of one
step from the family's ``flops_per_token``, and a step time on a named TPU generation at an
*assumed* MFU. The activation model is that of a decoder config with Llama's fields (``dim``,
``n_layers``, ``n_heads``, ``n_kv_heads``, ``ffn_hidden_dim``, ``vocab_size``).
:func:`estimate_from_config` reads the same from a composed ``tpu-train`` config. What XLA
says about the compiled step is :mod:`tpu_train.planning.analysis`; ``tpu-train plan`` puts
the two side by side.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from tpu_train.compile.layer_groups import scans
from tpu_train.models import checkpoint_family, family_of, named_config
from tpu_train.ops import attention_tpu
from tpu_train.parallel.family_plans import sharding_plan
from tpu_train.parallel.plans import over_context
from tpu_train.parallel.mesh import MeshShape, check_divisibility, resolve_mesh_shape

from .frozen_base import FrozenBase, frozen_base_of
from .frozen_base import weight_bytes as frozen_weight_bytes

__all__ = [
    "ASSUMED_MFU",
    "CHIPS",
    "Chip",
    "alignment_warnings",
    "estimate",
    "estimate_from_config",
    "get_chip",
    "architecture_overrides",
    "planned_model",
    "compute_dtype_of",
    "pieces",
    "setting",
]

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation: HBM per chip and dense bf16 peak."""

    name: str
    hbm_bytes: int
    bf16_tflops: float


CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 32 * GiB, 275.0),
    "v5e": Chip("v5e", 16 * GiB, 197.0),
    "v5p": Chip("v5p", 95 * GiB, 459.0),
    "v6e": Chip("v6e", 32 * GiB, 918.0),
    "v7": Chip("v7", 192 * GiB, 2307.0),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "trillium": "v6e", "ironwood": "v7",
            "v7x": "v7"}

# Model-FLOPs utilization assumed for step-time estimates. 40 % is what well-tuned
# FSDP/TP Llama training commonly reaches on TPUs; it is an assumption, printed with every
# estimate, never a measurement.
ASSUMED_MFU = 0.40
# A fraction of HBM kept free for XLA's own buffers, fragmentation and the runtime.
HEADROOM = 0.10
ALIGN = 128  # TPU MXU / lane width: dimensions that are multiples of 128 tile without padding


def get_chip(name: str) -> Chip:
    """The chip of generation ``name`` (``"v5e"``; a topology after ``:`` is ignored here)."""
    generation = name.lower().partition(":")[0].strip()
    key = _ALIASES.get(generation, generation)
    if key not in CHIPS:
        raise ValueError(f"unknown TPU generation {generation!r}; known: {', '.join(CHIPS)} "
                         f"(aliases {', '.join(_ALIASES)})")
    return CHIPS[key]


def _param_shards(cfg: Any, shape: MeshShape) -> tuple[int, int, int, int]:
    """Elements per chip: all parameters sharded; all gathered over ``fsdp`` (and
    ``context``, over which weights are stored split too: ``plans.over_context``); one layer
    gathered; the largest single gathered tensor.

    "Gathered" means after the FSDP all-gather: still split over ``tensor``.
    """
    family = family_of(cfg)
    plan = sharding_plan(family)
    sizes = {"data": shape.data, "fsdp": shape.fsdp, "expert": shape.expert,
             "tensor": shape.tensor, "context": shape.context}

    def axes_of(e):
        return () if e is None else (tuple(e) if isinstance(e, tuple) else (e,))

    def divides(spec, dims):
        return all(d % math.prod(sizes[a] for a in axes_of(e)) == 0
                   for d, e in zip(dims, spec))

    local = gathered = layer0 = largest = 0
    for name, dims in family.param_shapes(cfg).items():
        spec = plan.spec_for(name, dims)
        widened = over_context(spec, sizes)
        spec = widened if divides(widened, dims) else spec
        entries = tuple(spec) + (None,) * (len(dims) - len(spec))
        n = n_gathered = 1
        for d, e in zip(dims, entries):
            n *= d // math.prod(sizes[a] for a in axes_of(e))
            n_gathered *= d // math.prod(sizes[a] for a in axes_of(e)
                                         if a not in ("fsdp", "context"))
        local += n
        gathered += n_gathered
        largest = max(largest, n_gathered)
        if name.startswith("layers.0."):
            layer0 += n_gathered
    return local, gathered, layer0, largest


def activation_bytes(cfg: Any, shape: MeshShape, batch: int, seq_len: int, *,
                     activation_checkpointing: bool, act_bytes: int = 4,
                     flash_attention: bool = False, scan_layers: bool = False,
                     remat: str | None = None) -> dict[str, int]:
    """Activations one chip keeps for the backward pass, and the loss head's peak.

    Per layer and token (``t`` = tensor degree), saved for the backward without
    checkpointing: the residual input, two norm outputs and the attention output projection's
    input (``4 dim``), q, k, v and the GQA-expanded k, v (``(3 dim + 2 kv_dim) / t``), the
    attention scores before and after masking and the probabilities (``3 heads seq / t``) and
    the four SwiGLU tensors (``4 ffn / t``); with ``t > 1`` also the two row-parallel outputs,
    which are whole ``dim`` partial sums before their all-reduce (``2 dim``). With
    checkpointing only each layer's input (``dim``) is kept, plus one layer's full set during
    its recomputation. ``flash_attention`` replaces the ``seq x seq`` score terms with the
    per-row softmax statistics a fused attention kernel keeps (``2 heads / t``). The loss head holds logits, log-probabilities and their gradient
    (``3 vocab / t``) per token at its peak, plus (``t > 1``) its replicated input and
    all-reduced input gradient (``4 dim``). These coefficients match XLA's buffer assignment
    for the reference step within a few per cent once activations dominate (see the tests).
    ``scan_layers`` (the compiled step's default, without checkpointing): a scanned layer
    keeps its input and the projections' outputs its backward reads (``2 dim + (dim + 2
    kv_dim) / t + 2 ffn / t``: the input, the attention output projection's, q, k, v and the
    two SwiGLU projections'; the elementwise rest and the scores are recomputed, and the down
    projection's output is not kept, as only the residual add reads it,
    tpu_train.compile.layer_scan), plus one layer's full set while its backward runs.
    ``remat`` (``trainer.remat``; ``full`` is ``activation_checkpointing``): ``save_dots``
    keeps what a scanned layer keeps, ``save_qkv_proj`` the input and q, k, v (``dim +
    (dim + 2 kv_dim) / t``), each plus one layer's full set during its recomputation;
    ``offload`` only that set (the layers' inputs wait in host memory).
    Context parallelism (``shape.context``) divides every per-token figure's token count by
    its degree: each chip holds ``seq_len / context`` of each sequence; a token's scores still
    span the whole sequence (the keys are gathered), so the score terms keep ``seq_len``.
    """
    t = shape.tensor
    tokens = _tokens_per_chip(shape, batch, seq_len)
    per_layer, kept = _layer_elements(cfg, t, seq_len, flash_attention)
    kv = cfg.n_kv_heads * cfg.head_dim
    if remat == "save_dots":
        layers = tokens * (cfg.n_layers * kept + per_layer)
    elif remat == "save_qkv_proj":
        layers = tokens * (cfg.n_layers * (cfg.dim + (cfg.dim + 2 * kv) / t) + per_layer)
    elif activation_checkpointing or remat == "full":
        layers = tokens * (cfg.n_layers * cfg.dim + per_layer)
    elif remat == "offload":  # each layer's input is in host memory
        layers = tokens * per_layer
    elif scan_layers:
        layers = tokens * (cfg.n_layers * kept + per_layer)
    else:
        layers = tokens * cfg.n_layers * per_layer
    head = tokens * (3 * cfg.vocab_size / t + (4 * cfg.dim if t > 1 else 0))
    return {"layers": int(layers * act_bytes), "loss_head": int(head * act_bytes)}


def _tokens_per_chip(shape: MeshShape, batch: int, seq_len: int) -> int:
    return batch * seq_len // (shape.batch_shards * shape.context)


def context_kv(cfg: Any, shape: MeshShape, batch: int, seq_len: int, act_bytes: int,
               recomputed: bool) -> dict[str, int]:
    """Context parallelism's own costs per chip (zeros with ``context == 1``).

    ``bytes``: one layer's keys and values gathered over ``context`` (``2 kv_dim / t`` per
    token of the whole sequence, for this chip's rows) and their gradients before the
    reduce-scatter, live while that layer's attention runs. ``gather_bytes_per_step``: what
    the chip receives for them, ``(context - 1) / context`` of that per gather: each layer's
    forward all-gather, its backward reduce-scatter of the gradients, and a second gather
    where the layer's forward is recomputed (``recomputed``).
    """
    if shape.context == 1:
        return {"bytes": 0, "gather_bytes_per_step": 0}
    rows = batch // shape.batch_shards
    gathered = rows * seq_len * 2 * cfg.n_kv_heads * cfg.head_dim / shape.tensor * act_bytes
    moves = (3 if recomputed else 2) * cfg.n_layers
    return {"bytes": int(2 * gathered),
            "gather_bytes_per_step": int(moves * gathered * (shape.context - 1) / shape.context)}


def _ffn_width(cfg: Any) -> int:
    """The feed-forward units one token's activations span: a mixture of experts' (a config
    with ``n_experts``, like Mixtral's) ``dense`` form computes every expert for every token,
    its ``grouped`` form the ``top_k`` routed ones."""
    if getattr(cfg, "n_experts", None) is None:
        return cfg.ffn_hidden_dim
    return cfg.ffn_hidden_dim * (cfg.n_experts if cfg.moe_impl == "dense" else cfg.top_k)


def _layer_elements(cfg: Any, t: int, seq_len: int, flash_attention: bool) -> tuple[float, float]:
    """Per token: a layer's full set of activations, and what a scanned layer keeps
    (:func:`activation_bytes`)."""
    kv = cfg.n_kv_heads * cfg.head_dim
    ffn = _ffn_width(cfg)
    scores = 2 * cfg.n_heads / t if flash_attention else 3 * cfg.n_heads * seq_len / t
    per_layer = (4 * cfg.dim + (3 * cfg.dim + 2 * kv) / t + scores
                 + 4 * ffn / t + (2 * cfg.dim if t > 1 else 0))
    kept = 2 * cfg.dim + (cfg.dim + 2 * kv) / t + 2 * ffn / t
    return per_layer, kept


def _scanned_peak(cfg: Any, shape: MeshShape, batch: int, seq_len: int, *, grads: int,
                  one_layer: int, largest: int, param_bytes: float, act_bytes: int,
                  flash_attention: bool) -> dict[str, Any]:
    """Memory rows of a scanned step (no checkpointing) at its peak: the larger of two phases.

    Live throughout the backward: what each scanned layer keeps (:func:`activation_bytes`)
    and a second copy of the stacked layer inputs (the forward scan writes each layer's input
    into the stack it builds while the previous stack is still read). Then either the
    *head's backward* (the loss head's logits, log-probabilities and gradient; the gathered
    head and its unreduced gradient; no layer is gathered yet, as the layers' all-gathers are
    inside the loop) or the *first layer's backward* (the layers' stacked gradients; one
    layer's full set of activations, recomputed; that layer's gathered weights and unreduced
    gradient: the loop gathers no second layer ahead). Summing both phases overstated XLA's
    TPU figure by 13-16 % (Llama-3.1-8B on v5e:16x16, 70B on v5p:4x4x8, sequences of 128);
    the phases are within 4 % of it from 128 to 2048 tokens (docs/compile.md).
    """
    tokens = _tokens_per_chip(shape, batch, seq_len)
    per_layer, kept = _layer_elements(cfg, shape.tensor, seq_len, flash_attention)
    loss_head = activation_bytes(cfg, shape, batch, seq_len, activation_checkpointing=False,
                                 act_bytes=act_bytes)["loss_head"]
    always = int(tokens * cfg.n_layers * (kept + cfg.dim) * act_bytes)
    sharded = shape.fsdp > 1
    head = {"bytes_grads": 0, "bytes_loss_head": loss_head, "bytes_activations": always,
            "bytes_fsdp_gathered": 2 * largest * param_bytes if sharded else 0,
            "peak_phase": "the head's backward"}
    layer = {"bytes_grads": grads, "bytes_loss_head": 0,
             "bytes_activations": always + int(tokens * per_layer * act_bytes),
             "bytes_fsdp_gathered": 2 * one_layer * param_bytes if sharded else 0,
             "peak_phase": "the first layer's backward"}
    return max(head, layer, key=lambda rows: sum(v for k, v in rows.items()
                                                 if k.startswith("bytes_")))


def alignment_warnings(cfg: Any, shape: MeshShape | None = None) -> list[str]:
    """Dimensions that are not multiples of 128, globally or per shard, naming the config key."""
    dims = {"dim": cfg.dim, "ffn_hidden_dim": cfg.ffn_hidden_dim, "vocab_size": cfg.vocab_size}
    out = []
    for key, value in dims.items():
        if value % ALIGN:
            padded = -(-value // ALIGN) * ALIGN
            # Only the vocabulary can be padded without changing the model: the extra rows
            # are ids the tokenizer never produces. dim and ffn_hidden_dim are the model's own.
            fix = (f"set {type(cfg).__name__}.vocab_size to {padded} (the extra rows are ids the tokenizer "
                   "never produces)" if key == "vocab_size" else "fixed by the checkpoint")
            out.append(f"model.{key}={value} is not a multiple of {ALIGN}: XLA pads it to "
                       f"{padded} on TPU ({100 * (padded - value) / value:.1f} % wasted; {fix})")
    if cfg.head_dim % ALIGN:
        out.append(f"head_dim = dim / n_heads = {cfg.head_dim} is not a multiple of {ALIGN}: "
                   f"attention score matmuls contract over it and fill the MXU only partly "
                   f"(set by {type(cfg).__name__}.n_heads; usually fixed by the checkpoint)")
    if shape is not None:
        local = {"dim / fsdp": (cfg.dim, shape.fsdp),
                 "ffn_hidden_dim / tensor": (cfg.ffn_hidden_dim, shape.tensor),
                 "vocab_size / tensor": (cfg.vocab_size, shape.tensor)}
        for key, (value, ways) in local.items():
            if ways > 1 and value % ways == 0 and value % ALIGN == 0 and (value // ways) % ALIGN:
                out.append(f"per-chip shard {key} = {value // ways} is not a multiple of "
                           f"{ALIGN}: a smaller parallel degree keeps shards MXU-aligned")
    return out


def estimate(cfg: Any, *, num_devices: int, data: int = -1, fsdp: int = 1, tensor: int = 1,
             expert: int = 1, batch: int, seq_len: int, activation_checkpointing: bool = False,
             chip: str | None = None, mfu: float = ASSUMED_MFU, num_slices: int = 1,
             param_bytes: int = 4, act_bytes: int = 4, state_bytes: int | None = None,
             flash_attention: bool = False, grad_accum_steps: int = 1,
             scan_layers: bool = False, remat: str | None = None,
             frozen_base: FrozenBase | None = None, context: int = 1) -> dict[str, Any]:
    """Analytic per-chip memory and step time of training ``cfg`` with AdamW.

    ``batch`` is the global micro-batch (sequences per forward/backward), which must split
    evenly over ``data * fsdp``; a step runs ``grad_accum_steps`` of them (FLOPs scale, and
    a float32 gradient accumulator, sharded like the gradients, is added when it is > 1). Parameters and gradients take ``param_bytes`` each (fp32 master weights
    by default), AdamW's two moments ``state_bytes`` each (None: ``param_bytes``, as
    ``torch.optim`` keeps them; 2 for ``optim.state_dtype=bf16``); activations ``act_bytes`` each (2 under bf16
    autocast). ``flash_attention``: attention scores are not materialized. FSDP additionally
    needs the all-gathered (still tensor-sharded) weights: all of them without checkpointing
    (the backward reuses the forward's gathered weights) and one unreduced gradient in flight
    (the largest of a layer's and a single tensor's); with checkpointing or ``scan_layers``
    (which gathers each layer's weights inside the loop, and stacks every layer's local weight
    shards once) the larger of the head's backward (head gathered, its gradient unreduced, a
    layer prefetched) and a layer's (two layers gathered, one layer's gradient unreduced).
    Scanned layers without checkpointing: the larger of two whole phases, each with its own
    gradients, FSDP working set and activations (:func:`_scanned_peak`); ``peak_phase`` names
    it (None when the rows are a sum over the step). ``context``: each sequence split over
    that many chips (:func:`context_kv`: ``bytes_context_kv``, ``context_kv_gather_bytes``).
    ``remat`` (``trainer.remat``): ``full`` is ``activation_checkpointing``; ``save_dots`` and
    ``save_qkv_proj`` keep part of each layer (:func:`activation_bytes`), gather weights as
    checkpointing does, and are costed at checkpointing's FLOPs (an upper bound).
    ``frozen_base`` (a LoRA run, :mod:`.frozen_base`): the weights are the frozen base as
    stored (int8 for an int8 base) plus the adapters, and only the adapters (replicated) have
    gradients, moments and an accumulator.
    Returns a flat dict of figures (bytes, FLOPs, seconds) plus ``fits`` and ``warnings``.
    """
    remat = remat or ("full" if activation_checkpointing else "none")
    activation_checkpointing = remat == "full"
    # Context-parallel attention runs blockwise or as the splash kernels and keeps per-row
    # statistics, as a fused kernel does (tpu_train.ops.context_attention{,_tpu}).
    flash_attention = flash_attention or context > 1
    shape = resolve_mesh_shape(num_devices, data, fsdp, tensor, num_slices=num_slices,
                               expert=expert, context=context)
    family = family_of(cfg)
    check_divisibility(family.split_sizes(cfg), shape)
    if seq_len % (2 * shape.context):
        raise ValueError(f"seq_len {seq_len} must split into 2 x context = "
                         f"{2 * shape.context} equal chunks")
    if batch % shape.batch_shards:
        raise ValueError(f"global batch {batch} must be a multiple of data * fsdp * expert = "
                         f"{shape.batch_shards}")
    if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) \
            or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be a positive int, got {grad_accum_steps!r}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    local, gathered, one_layer, largest = _param_shards(cfg, shape)
    trained, weight_bytes = local, param_bytes
    params = local * param_bytes
    if frozen_base is not None:
        frozen, trained, elements = frozen_weight_bytes(cfg, frozen_base, param_bytes)
        weight_bytes = frozen / elements  # per weight, on average, for the gathered copies
        params = int(frozen * local / elements) + trained * param_bytes
    grads = trained * param_bytes
    optimizer = 2 * trained * (param_bytes if state_bytes is None else state_bytes)
    fsdp_working = _fsdp_working_bytes(cfg, shape, gathered, one_layer, largest, weight_bytes,
                                       remat != "none" or scan_layers)
    # A scanned stack reads its layers' weights as one stacked copy (made each step).
    stacked = int(local * weight_bytes * cfg.n_layers * one_layer / gathered) \
        if scan_layers and gathered else 0
    acts = activation_bytes(cfg, shape, batch, seq_len,
                            activation_checkpointing=activation_checkpointing, act_bytes=act_bytes,
                            flash_attention=flash_attention, scan_layers=scan_layers,
                            remat=remat)
    rows = {"bytes_grads": grads, "bytes_fsdp_gathered": fsdp_working,
            "bytes_activations": acts["layers"], "bytes_loss_head": acts["loss_head"],
            "peak_phase": None}
    if scan_layers and remat in ("none", "save_dots"):
        rows = _scanned_peak(cfg, shape, batch, seq_len, grads=grads, one_layer=one_layer,
                             largest=largest, param_bytes=weight_bytes, act_bytes=act_bytes,
                             flash_attention=flash_attention)
    kv = context_kv(cfg, shape, batch, seq_len, act_bytes, remat != "none" or scan_layers)
    rows["bytes_context_kv"] = kv["bytes"]
    accumulator = trained * 4 if grad_accum_steps > 1 else 0
    total = (params + optimizer + accumulator + stacked
             + sum(v for k, v in rows.items() if k.startswith("bytes_")))

    tokens = batch * seq_len * grad_accum_steps
    model_flops = family.flops_per_token(cfg, seq_len) * tokens
    # Checkpointing re-runs each layer's forward (1/3 of 6N): same work, fewer useful FLOPs.
    recompute = remat in ("full", "save_qkv_proj", "offload")
    hardware_flops = model_flops * (4 / 3 if recompute else 1)
    if frozen_base is not None:
        # No gradients of the frozen weights: their matmuls cost 2 + 2 (+ 2 recomputed) of
        # the 6 per weight and token; attention's products are all still needed.
        attention = 12 * cfg.n_layers * cfg.dim * seq_len * tokens
        hardware_flops = ((model_flops - attention) * (6 if recompute else 4) / 6
                          + attention * (4 / 3 if recompute else 1))
    result: dict[str, Any] = {
        "mesh": shape.as_dict(), "num_devices": num_devices, "batch": batch,
        "seq_len": seq_len, "activation_checkpointing": activation_checkpointing,
        "remat": remat,
        "flash_attention": flash_attention, "activation_bytes_per_element": act_bytes,
        "num_params": family.num_params(cfg),
        "trained_params": trained if frozen_base else None,
        "base_dtype": ("int8" if frozen_base.int8 else "param") if frozen_base else None,
        "grad_accum_steps": grad_accum_steps,
        "bytes_params": params, "bytes_optimizer": optimizer,
        "bytes_grad_accumulator": accumulator, "bytes_stacked_layers": stacked,
        "scan_layers": scan_layers, **rows, "bytes_total": total,
        "model_flops_per_step": model_flops,
        "hardware_flops_per_chip": hardware_flops / num_devices,
        "tokens_per_step": tokens,
        "context_kv_gather_bytes": kv["gather_bytes_per_step"],
        "warnings": alignment_warnings(cfg, shape),
    }
    if chip is not None:
        result.update(_chip_figures(get_chip(chip), hardware_flops / num_devices,
                                    tokens / num_devices, total, mfu))
    return result


def _fsdp_working_bytes(cfg, shape, gathered, one_layer, largest, param_bytes: float,
                        gathered_at_use: bool) -> int:
    """Bytes of all-gathered weights and unreduced gradients FSDP holds at its peak."""
    if shape.fsdp == 1:
        return 0
    # Gathered weights: the backward reads every layer's weights again, so without
    # checkpointing all of them stay live from the forward, beside the largest unreduced
    # gradient in flight (gradients are reduce-scattered as they are made).
    working = gathered + max(one_layer, largest)
    if gathered_at_use:
        # Gathered where ops read them instead, a layer's worth at a time with the next
        # one gathered meanwhile (compile/interpreter.py, layer_scan.py): the peak is the
        # larger of two phases, not their sum. The head's backward holds the gathered
        # head, its unreduced gradient and the first layer being gathered; a layer's
        # backward holds two layers' gathered weights and one layer's unreduced gradient.
        head_phase = 2 * largest + one_layer
        layer_phase = (min(2, cfg.n_layers) + 1) * one_layer
        working = min(working, max(head_phase, layer_phase))
    return int(working * param_bytes)


def _chip_figures(c, hardware_flops_per_chip: float, tokens_per_chip: float, total: int,
                  mfu: float) -> dict[str, Any]:
    """Step time at ``mfu`` of chip ``c``'s bf16 peak, and whether ``total`` bytes fit."""
    step_s = hardware_flops_per_chip / (c.bf16_tflops * 1e12 * mfu)
    usable = int(c.hbm_bytes * (1 - HEADROOM))
    return {"chip": c.name, "chip_hbm_bytes": c.hbm_bytes, "chip_bf16_tflops": c.bf16_tflops,
            "assumed_mfu": mfu, "step_time_s": step_s,
            "tokens_per_s_per_chip": tokens_per_chip / step_s,
            "fits": total <= usable, "hbm_use_fraction": total / c.hbm_bytes}


def compute_dtype_of(config: Any, changes: dict | None = None) -> torch.dtype | None:
    """The dtype ``trainer.precision`` (or ``changes``' value for it) computes the step in
    (``torch.bfloat16`` for bf16; None: the weights' own), as the trainer's
    ``Precision.compute_dtype`` gives it to the step."""
    precision = setting(config, "trainer.precision", changes)
    name = str(getattr(precision, "value", precision))
    return torch.bfloat16 if name == "bf16" else None


# The model section's fields that change the architecture its name or checkpoint gives.
ARCHITECTURE_OVERRIDES = ("n_layers", "max_seq_len")


def architecture_overrides(model_section: Any) -> dict[str, int]:
    """``model.n_layers`` / ``model.max_seq_len`` where set, as ``LlamaConfig`` field changes."""
    return {key: int(value) for key in ARCHITECTURE_OVERRIDES
            if (value := getattr(model_section, key, None)) is not None}


def planned_model(name: str, checkpoint: str | None = None, **overrides: int):
    """The architecture to plan: a Hugging Face checkpoint's config.json when ``checkpoint``
    names one (as the trainer builds it), else the named preset; ``overrides``
    (:func:`architecture_overrides`) applied."""
    if checkpoint is not None and (Path(checkpoint) / "config.json").is_file():
        config = checkpoint_family(checkpoint).hf.read_config(checkpoint)[1]
    else:
        config = named_config(name)
    return dataclasses.replace(config, **overrides) if overrides else config


def stored_dtype(dtype_setting: Any) -> torch.dtype | None:
    """The dtype ``trainer.param_dtype`` / ``optim.state_dtype`` stores values in (None:
    unset, or ``param``: the parameters' own)."""
    value = getattr(dtype_setting, "value", dtype_setting)
    return {"bf16": torch.bfloat16, "fp32": torch.float32}.get(value)


def stored_bytes(dtype_setting: Any) -> int | None:
    """Bytes per value of :func:`stored_dtype` (None where that is None)."""
    dtype = stored_dtype(dtype_setting)
    return dtype.itemsize if dtype is not None else None


def remat_of(config: Any) -> str:
    """The composed config's remat policy (``trainer.remat``, ``activation_checkpointing``)."""
    from tpu_train.parallel.activation_checkpointing import remat_setting

    trainer = config.trainer
    return remat_setting(trainer.get("remat", "none"),
                         bool(trainer.get("activation_checkpointing", False)))


def setting(config: Any, key: str, changes: dict | None = None) -> Any:
    """The composed config's value at dotted ``key`` (``"parallel.fsdp"``), or ``changes``'
    (the settings :mod:`.fit` tries) where it has one; None where the config has no such key."""
    if changes and key in changes:
        return changes[key]
    node = config
    for part in key.split("."):
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
        if node is None:
            return None
    return node


def pieces(config: Any, shards: int, changes: dict | None = None) -> tuple[int, int]:
    """``(global rows one forward/backward runs, pieces one step accumulates)``, as the
    trainer splits a step: ``trainer.grad_accum_steps`` micro-batches of ``data.batch_size``
    rows, each cut into ``trainer.micro_batch_size`` rows per batch shard where that is
    fewer than a shard's rows (tpu_train.trainer.layouts)."""
    batch = int(setting(config, "data.batch_size", changes))
    accum = int(setting(config, "trainer.grad_accum_steps", changes) or 1)
    rows = batch // shards
    micro = setting(config, "trainer.micro_batch_size", changes)
    if micro is None or int(micro) >= rows:
        return batch, accum
    if rows % int(micro):
        raise ValueError(f"trainer.micro_batch_size={micro} must divide the {rows} rows each "
                         f"batch shard computes (data.batch_size={batch} over {shards})")
    return int(micro) * shards, accum * (rows // int(micro))


def estimate_from_config(config: Any, num_devices: int | None = None,
                         chip: str | None = None, mfu: float = ASSUMED_MFU, *,
                         remat: str | None = None, batch: int | None = None,
                         changes: dict | None = None) -> dict[str, Any]:
    """:func:`estimate` for a composed ``tpu-train`` config (the ``tpu-train plan`` command).

    Reads ``model.name`` (or ``model.checkpoint``'s config.json), ``data.batch_size`` and
    ``data.seq_len``, ``parallel.{data,fsdp,tensor,expert,context}``, ``trainer.{remat,
    activation_checkpointing,precision,grad_accum_steps,micro_batch_size,scan_layers,
    param_dtype}``, ``optim.state_dtype`` and
    ``plan.chip`` (``chip`` overrides it). ``num_devices`` is needed only when a degree is -1;
    otherwise it is their product. ``changes`` (dotted keys to values) replaces what the
    config says; ``remat`` and ``batch`` (the global micro-batch, rows run at once) replace
    the config's policy and micro-batch.
    """
    degrees = tuple(int(setting(config, f"parallel.{axis}", changes))
                    for axis in ("data", "fsdp", "tensor"))
    expert = int(setting(config, "parallel.expert", changes) or 1)
    context = int(setting(config, "parallel.context", changes) or 1)
    if num_devices is None:
        if -1 in degrees + (expert,):
            raise ValueError(
                f"parallel.data/fsdp/tensor/expert = {degrees + (expert,)} contains -1: planning "
                f"needs the chip count, pass num_devices (or set every degree explicitly)")
        num_devices = math.prod(degrees) * expert * context
    compute_dtype = compute_dtype_of(config, changes)
    cfg = planned_model(config.model.name, config.model.checkpoint,
                        **architecture_overrides(config.model))
    shards = resolve_mesh_shape(num_devices, *degrees, expert=expert,
                                context=context).batch_shards
    rows, splits = pieces(config, shards, changes)
    if batch is not None:  # a micro-batch of ``batch`` rows: the step's pieces follow
        splits, rows = splits * rows // batch, batch
    policy = remat or (changes or {}).get("trainer.remat") or remat_of(config)
    chip = chip or config.plan.chip
    seq_len = int(config.data.seq_len)
    # On a TPU the attention kernels keep no seq x seq scores (tpu_train.ops.attention_tpu).
    fused = chip is not None and attention_tpu.kernels_would_run(
        seq_len, cfg.dim // cfg.n_heads, bf16=compute_dtype == torch.bfloat16)
    param_bytes = stored_bytes(setting(config, "trainer.param_dtype", changes)) or 4
    base = frozen_base_of(config, param_bytes, compute_dtype.itemsize if compute_dtype else None,
                          changes)
    return estimate(
        cfg, num_devices=num_devices, data=degrees[0], fsdp=degrees[1], tensor=degrees[2],
        expert=expert, batch=rows, seq_len=seq_len,
        remat=policy, flash_attention=fused,
        chip=chip, mfu=mfu, num_slices=int(setting(config, "plan.num_slices") or 1),
        act_bytes=compute_dtype.itemsize if compute_dtype else 4, grad_accum_steps=splits,
        param_bytes=param_bytes,
        state_bytes=stored_bytes(setting(config, "optim.state_dtype", changes)),
        scan_layers=scans(setting(config, "trainer.scan_layers", changes), cfg.n_layers),
        frozen_base=base,
        context=context)
