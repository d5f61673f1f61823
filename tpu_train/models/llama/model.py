"""The Llama decoder in plain PyTorch.

Every op in the training forward is static in shape and free of data-dependent Python
control flow, so the same module runs eagerly on any device and traces with ``make_fx``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaConfig
from .kv_cache import KVCache
from .rope import apply_rotary, rope_tables

__all__ = ["Attention", "FeedForward", "Llama", "RMSNorm", "TransformerBlock", "document_mask",
           "init_weights", "initial_values", "local_causal_mask"]

# Hugging Face's initializer_range for Llama.
_INIT_STD = 0.02


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The statistics are taken in float32 even for bf16 activations (as in the reference
        # implementation): the mean of squares loses too much precision in bf16.
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings; q/k/v biases with
    ``cfg.qkv_bias``, and with ``cfg.sliding_window`` each query sees only the last
    ``sliding_window`` positions up to its own."""

    def __init__(self, cfg: LlamaConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.sliding_window = cfg.sliding_window
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                start_pos: int = 0, cache: KVCache | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` (boolean, True where a query may attend to a key; see
        :func:`document_mask`) replaces the causal (and sliding-window) mask; it takes no
        cache."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_id, start_pos, k, v)
        # Query head h reads kv head h // (n_heads / n_kv_heads); the key/value heads are not
        # repeated in memory.
        gqa = self.n_heads != self.n_kv_heads
        total = k.shape[2]
        window = self.sliding_window
        if mask is None and window is not None and total > window:
            # The window cuts: the keys a query may see end at its own position (bottom-right
            # aligned after a cached prefix) and span `window` positions.
            mask = local_causal_mask(seq, total, window, q.device)
        if mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        elif total == seq:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif seq == 1:
            # A single new query may see every cached position.
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        else:
            # A block of queries after a cached prefix: is_causal would align the triangle to
            # the top-left corner, so build the bottom-right aligned mask explicitly.
            mask = torch.ones(seq, total, dtype=torch.bool, device=q.device).tril(total - seq)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm attention + pre-norm MLP, each with a residual connection."""

    def __init__(self, cfg: LlamaConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                start_pos: int = 0, cache: KVCache | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        # The mask only when there is one: plans that prepare the attention's inputs by
        # position (torch's PrepareModuleInput) name five, as before packed rows.
        extra = () if mask is None else (mask,)
        h = x + self.attention(self.attention_norm(x), cos, sin, start_pos, cache, *extra)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama 2 / 3 / 3.1 / 3.2 decoder-only language model, and the Qwen2 / Qwen2.5 and
    Mistral decoders through the options of :class:`LlamaConfig`.

    Build cheaply on the meta device and materialize afterwards::

        with torch.device("meta"):
            model = Llama(get_config("llama3_1_8b"))
        model.init_weights(seed=0, device="cpu")

    With ``tie_embeddings`` there is no ``output`` module: the logits reuse
    ``tok_embeddings.weight``, so the model holds a single parameter for both.
    """

    # The decoder layer, ``block_class(config, layer_id)``: a subclass may bring its own.
    block_class = TransformerBlock

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(self.block_class(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = (None if config.tie_embeddings
                       else nn.Linear(config.dim, config.vocab_size, bias=False))
        # Non-persistent: derived from the config, never stored in checkpoints.
        cos, sin = _empty_or_computed_rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, *, start_pos: int = 0,
                cache: KVCache | None = None, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]``: the :meth:`hidden_states` times the output weight
        (``tok_embeddings.weight`` with ``tie_embeddings``)."""
        h = self.hidden_states(tokens, start_pos=start_pos, cache=cache,
                               position_ids=position_ids, segment_ids=segment_ids)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    def hidden_states(self, tokens: torch.Tensor, *, start_pos: int = 0,
                      cache: KVCache | None = None, position_ids: torch.Tensor | None = None,
                      segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output ``[batch, seq, dim]``, which the output layer turns into
        logits ``[batch, seq, vocab]`` for ``tokens`` ``[batch, seq]`` at positions
        ``start_pos ... start_pos + seq - 1``; with ``cache``, attention also covers the
        cached positions before ``start_pos``.

        Packed rows (several samples one after the other, no cache): ``position_ids``
        ``[batch, seq]`` gives each token's rotary position (restarting at 0 in each sample)
        and ``segment_ids`` ``[batch, seq]`` which sample it belongs to; a token then attends
        only to the earlier tokens of its own segment (:func:`document_mask`)."""
        h, cos, sin, extra = self.prepare_inputs(tokens, start_pos, cache, position_ids,
                                                 segment_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, start_pos, cache, *extra)
        return self.norm(h)

    def prepare_inputs(self, tokens, start_pos, cache, position_ids, segment_ids):
        """The checked inputs of the layers: ``(embeddings, cos, sin, (mask,) or ())``."""
        if tokens.dim() != 2:
            raise ValueError(
                f"tokens must be a [batch, seq] tensor of token ids, got shape {tuple(tokens.shape)}"
            )
        seq = tokens.shape[1]
        if start_pos < 0 or start_pos + seq > self.config.max_seq_len:
            raise ValueError(
                f"positions {start_pos}..{start_pos + seq - 1} exceed the model's max_seq_len "
                f"{self.config.max_seq_len}; shorten the input or raise config.max_seq_len"
            )
        _check_packed_inputs(tokens, position_ids, segment_ids, start_pos, cache)
        mask = self._attention_mask(tokens, segment_ids, cache)
        if position_ids is None:
            cos = self.rope_cos[start_pos:start_pos + seq]
            sin = self.rope_sin[start_pos:start_pos + seq]
        else:  # [batch, 1, seq, head_dim // 2]: one angle per token, shared by the heads
            cos = self.rope_cos[position_ids].unsqueeze(1)
            sin = self.rope_sin[position_ids].unsqueeze(1)
        return self.tok_embeddings(tokens), cos, sin, () if mask is None else (mask,)

    def _attention_mask(self, tokens, segment_ids, cache) -> torch.Tensor | None:
        """The mask every layer shares, or None where attention is plain causal (or, with a
        cache, where each layer builds its own from the cached length)."""
        window = self.config.sliding_window
        if segment_ids is not None:
            return document_mask(segment_ids, window)
        seq = tokens.shape[1]
        if cache is None and window is not None and seq > window:
            # [1, 1, seq, seq]: one mask for every row and head, as a document mask is.
            return local_causal_mask(seq, seq, window, tokens.device)[None, None]
        return None

    def reset_rope_tables(self) -> None:
        """Recompute the RoPE buffers in place (after ``to_empty`` or a config change)."""
        cos, sin = rope_tables(self.config)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def init_weights(self, seed: int = 0, device: torch.device | str | None = None) -> "Llama":
        """See :func:`init_weights`."""
        return init_weights(self, seed, device)


def local_causal_mask(seq: int, total: int, window: int | None,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """``[seq, total]`` booleans for ``seq`` queries at the last positions of ``total`` keys:
    query ``i`` (at position ``total - seq + i``) may see key ``j`` when ``j`` is at most that
    position and, with a ``window``, fewer than ``window`` positions before it."""
    offset = total - seq
    mask = torch.ones(seq, total, dtype=torch.bool, device=device).tril(offset)
    if window is not None:
        mask = mask.triu(offset - window + 1)
    return mask


def document_mask(segment_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The attention mask of packed rows: ``[batch, 1, seq, seq]``, True where query ``i``
    may attend to key ``j``: ``j <= i`` (and ``i - j < window``) and both in the same
    segment."""
    seq = segment_ids.shape[-1]
    causal = local_causal_mask(seq, seq, window, segment_ids.device)
    same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


def _check_packed_inputs(tokens, position_ids, segment_ids, start_pos, cache) -> None:
    for name, ids in (("position_ids", position_ids), ("segment_ids", segment_ids)):
        if ids is not None and tuple(ids.shape) != tuple(tokens.shape):
            raise ValueError(f"{name} must have the shape of tokens {tuple(tokens.shape)}, got "
                             f"{tuple(ids.shape)}")
    if (position_ids is not None or segment_ids is not None) and (cache is not None or start_pos):
        raise ValueError("position_ids / segment_ids describe packed rows and take no cache or "
                         "start_pos; pass one or the other")


def _empty_or_computed_rope_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (cfg.max_seq_len, cfg.head_dim // 2)
    if torch.empty(0).device.type == "meta":
        return torch.empty(shape), torch.empty(shape)
    cos, sin = rope_tables(cfg)
    default_device = torch.empty(0).device
    return cos.to(default_device), sin.to(default_device)


def _init_std(name: str, cfg: LlamaConfig) -> float | None:
    """Standard deviation for a parameter, or ``None`` for norm scales (initialized to one)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w2")):
        # Residual-branch outputs shrink with depth so the residual stream's variance stays
        # roughly constant at initialization (GPT-2 style).
        return _INIT_STD / math.sqrt(2 * cfg.n_layers)
    return _INIT_STD


def _same_device(requested: torch.device, actual: torch.device) -> bool:
    # "tpu" (no index) names whichever tpu device the tensor is on.
    return requested.type == actual.type and requested.index in (None, actual.index)


# The most elements of one weight drawn at once (64 MiB of float32): an 8B's embedding table is
# not drawn whole (2 GiB) beside the model.
INIT_PIECE_ELEMENTS = 2**24


def _row_pieces(shape: tuple[int, ...], limit: int):
    """Slices of the first dimension of a weight of ``shape``, each of at most ``limit``
    elements (at least one row); ``[None]`` (whole) where it is smaller. A piece is a multiple
    of 16 elements, the block torch's CPU ``normal_`` fills at a time, so that drawing the
    pieces one after the other gives the values of drawing the whole."""
    row = math.prod(shape[1:])
    if not shape or math.prod(shape) <= limit or row % 16:
        return [None]
    step = max(1, limit // row)
    return [slice(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]


def initial_values(config: LlamaConfig, shapes, seed: int = 0,
                   piece_elements: int | None = None):
    """The seeded initial values of the parameters ``shapes`` (``[(name, shape)]`` in
    ``named_parameters`` order), one piece at a time: ``(name, rows, float32 value)``, where
    ``rows`` is a slice of the parameter's first dimension or None for all of it. What
    :func:`init_weights` writes; a caller that stores each piece as it comes (quantized, say)
    never holds the whole model in float32."""
    limit = INIT_PIECE_ELEMENTS if piece_elements is None else piece_elements
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, shape in shapes:
        if name.endswith(".bias"):  # q/k/v biases start at zero, as Hugging Face's
            yield name, None, torch.zeros(shape)
            continue
        std = _init_std(name, config)
        if std is None:
            yield name, None, torch.ones(shape)
            continue
        for rows in _row_pieces(shape, limit):
            size = shape if rows is None else (rows.stop - rows.start, *shape[1:])
            yield name, rows, torch.empty(size).normal_(mean=0.0, std=std, generator=generator)


def init_weights(model: Llama, seed: int = 0,
                 device: torch.device | str | None = None) -> Llama:
    """Materialize (if on the meta device) and initialize ``model`` deterministically.

    Values are drawn in float32 on the CPU from a generator seeded with ``seed``, one
    parameter at a time in ``named_parameters`` order, then copied to the parameter's device
    and dtype: the same seed gives the same weights on every device and in every dtype.
    Linear and embedding weights (and stacked expert weights) are N(0, 0.02), the residual
    output projections (``wo``, ``w2``) N(0, 0.02 / sqrt(2 * n_layers)), norm scales one,
    q/k/v biases zero (drawing nothing, so a Llama's weights are the same with or without
    them). A model on the meta device is first moved with ``to_empty(device=device or
    "cpu")``; otherwise ``device`` must be None or the model's device.
    """
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.is_meta for t in tensors):
        model.to_empty(device=device if device is not None else "cpu")
    elif device is not None and not _same_device(torch.device(device),
                                                 model.tok_embeddings.weight.device):
        raise ValueError(
            f"init_weights(device={device!r}) on a model already on "
            f"{model.tok_embeddings.weight.device}; move it with model.to(...) instead"
        )
    params = dict(model.named_parameters())
    shapes = [(name, tuple(param.shape)) for name, param in params.items()]
    with torch.no_grad():
        for name, rows, value in initial_values(model.config, shapes, seed):
            (params[name] if rows is None else params[name][rows]).copy_(value)
    model.reset_rope_tables()
    return model
