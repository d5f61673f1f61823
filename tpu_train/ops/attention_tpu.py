"""Attention on a TPU through JAX's Pallas splash-attention kernels (forward and backward).

The XLA formulation (:mod:`tpu_train.ops.attention`) writes and reads ``[B, H, S, S]`` scores
and probabilities in HBM, in the forward and again in the backward; the splash kernels stream
them through on-chip memory in blocks. Measured on one TPU v5e (forward + backward, bf16,
head_dim 64, causal, 2026-12-04): 8 x 16 heads (8 kv) x 1024 tokens 3.0 ms against 6.0 ms for
the XLA form, 4 x 32 (8) x 2048 8.0 against 20.4 ms, but 4 x 8 (4) x 256 0.87 against 0.79 ms.
512 tokens has no figure yet, so the rule starts at the shortest measured win, 1024
(``scripts/bench_attention.py`` measures all four on the chip that is there). The rule of
:func:`supported`:

* the program is lowered for a TPU (``lax.platform_dependent``: the same traced program lowered
  for another platform takes the XLA form). XLA's SPMD partitioner does not split a Pallas
  kernel: in a program partitioned over a mesh (:func:`per_shard`) the kernels run in a
  ``shard_map``, each device on its rows and heads, where the batch splits over the mesh's
  batch axes and the query and key heads over its head axis (else the XLA form);
* no dropout, no additive mask: none, or ``is_causal`` (the kernel's ``CausalMask``,
  evaluated from iotas inside the kernel, never materialised), or a boolean mask shared by the
  heads (``[B or 1, 1, S, S]``) that may be a *document mask* (packed rows: causal and within a
  segment, see :func:`document_segments`). Such a mask's segment ids are read from it inside
  the program, and the mask is compared with the one they make: where it is one, the kernels
  run with ``CausalMask`` and those ``SegmentIds``; any other mask takes the XLA form
  (``lax.cond``: both are compiled, one runs);
* under :func:`sliding_window` (a model whose tokens see only the last ``window`` positions,
  Mistral), the boolean mask is checked against causal-within-segments *and* within the
  window, and the kernels run with the splash library's ``LocalMask`` (blocks wholly outside
  the window are skipped) and those segment ids; a mask that is not that one takes the XLA
  form. The window must be declared: it sizes the kernel's block tables, which are built on
  the host, and a mask inside a program is a traced value;
* self-attention lengths (``Sq == Sk``), a multiple of 128 (the kernel's lane tiles) and at
  least :data:`MIN_SEQUENCE` tokens;
* head_dim a multiple of 64 (the measured sizes), the same for values;
* bfloat16 inputs (the measured ones). Float32 stays on the XLA form; under :func:`kernels`
  it takes the kernels too, whose float32 dots then follow the project's float32 matmul
  precision (``torch.set_float32_matmul_precision``) as the XLA form's do.

Grouped-query heads use the kernel's multi-query form mapped over the batch and the kv heads
(the query heads of one kv head share its keys and values): K and V are never repeated. The
kernel takes no scale: the query is scaled before it (in its own dtype) and the query's gradient
after. The forward returns the logsumexp PyTorch's fused op returns (natural log of the scaled
scores), and the backward consumes it with the output, so the backward kernels run without a
second forward pass: :func:`backward` calls the kernel library's own backward rule
(``_splash_attention_bwd``, private to jax's splash module, pinned by ``constraints.txt``; the
interpret-mode tests in ``tests/ops/test_attention_tpu.py`` fail if a JAX update changes it).

The kernel objects hold the mask's block tables. They are built on the host as NumPy arrays and
cached per shape: built inside a trace with the kernel library's own ``jnp.array``, they would
be tracers of that trace, and a later trace reusing the cached kernel would lower them as extra
parameters of its program ("Computation compiled for N inputs but called with M").
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import numpy

from tpu_train.ops import context_attention, matmul

# Below this many tokens the XLA form was as fast or faster on a v5e (module docstring).
MIN_SEQUENCE = 1024
_LANES = 128
_HEAD_DIM_MULTIPLE = 64
_BLOCK = 512

_XLA_FORM = contextvars.ContextVar("tpu_train_attention_xla_form", default=False)
# (mesh, batch axes, head axis) of a partitioned program: the kernels run per shard.
_PER_SHARD = contextvars.ContextVar("tpu_train_attention_per_shard", default=None)
# The sliding window (in tokens, the query's own included) that boolean masks are checked
# against for the kernels; None: plain causal within segments.
_WINDOW = contextvars.ContextVar("tpu_train_attention_window", default=None)
# (min_sequence, interpret): the rule's length threshold moved, and the kernels run on any
# platform in Pallas' interpret mode (:func:`kernels`).
_OVERRIDE = contextvars.ContextVar("tpu_train_attention_override", default=None)


@contextlib.contextmanager
def xla_form():
    """Attention lowered inside takes the XLA form on every platform: benchmarks and cost
    comparisons of the two forms."""
    token = _XLA_FORM.set(True)
    try:
        yield
    finally:
        _XLA_FORM.reset(token)


@contextlib.contextmanager
def per_shard(mesh, batch_axes: tuple[str, ...] = ("data", "fsdp", "expert"),
              head_axis: str = "tensor"):
    """Attention lowered inside belongs to a program partitioned over ``mesh`` (a
    ``jax.sharding.Mesh``): the kernels run in a ``shard_map``, each device on its share of
    the batch (over ``batch_axes``, those the mesh has) and of the heads (over ``head_axis``).
    A call whose batch or heads do not split that way takes the XLA form."""
    token = _PER_SHARD.set((mesh, tuple(batch_axes), head_axis))
    try:
        yield
    finally:
        _PER_SHARD.reset(token)


def _shard_specs(query, key):
    """``(mesh, specs)`` of a call under :func:`per_shard`, ``specs`` naming the
    ``PartitionSpec`` of each operand kind (``"heads"``: ``[B, H, S, D]``, ``"rows_heads"``:
    ``[B, H, S]``, ``"rows"``: ``[B, S]``); None where its batch or heads do not split."""
    from jax.sharding import PartitionSpec

    mesh, batch_axes, head_axis = _PER_SHARD.get()
    sizes = dict(mesh.shape)
    rows = tuple(a for a in batch_axes if int(sizes.get(a, 1)) > 1)
    heads = int(sizes.get(head_axis, 1))
    if query.shape[0] % math.prod(int(sizes[a]) for a in rows) or (
            heads > 1 and (query.shape[1] % heads or key.shape[1] % heads)):
        return None
    b, h = (rows or None), (head_axis if heads > 1 else None)
    return mesh, {"heads": PartitionSpec(b, h, None, None), "rows_heads": PartitionSpec(b, h, None),
                  "rows": PartitionSpec(b, None)}


def _on_shards(local, operands: tuple, segments, kinds: tuple[str, ...], out_kinds,
               query, key):
    """``local(*operands, segments)``; under :func:`per_shard`, on each device's share: the
    operands split as their ``kinds`` say (:func:`_shard_specs`; ``query`` and ``key`` decide),
    ``segments`` (``[B, S]``) by rows, the results as ``out_kinds``."""
    if _PER_SHARD.get() is None:
        return local(*operands, segments)
    mesh, specs = _shard_specs(query, key)
    in_specs = tuple(specs[k] for k in kinds)
    out_specs = tuple(specs[k] for k in out_kinds)
    if segments is None:
        return jax.shard_map(lambda *xs: local(*xs, None), mesh=mesh, in_specs=in_specs,
                             out_specs=out_specs, check_vma=False)(*operands)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs + (specs["rows"],),
                         out_specs=out_specs, check_vma=False)(*operands, segments)


@contextlib.contextmanager
def kernels(min_sequence: int = _LANES, interpret: bool = False):
    """Inside, the rule takes the kernels from ``min_sequence`` tokens (benchmarks measure
    below :data:`MIN_SEQUENCE`) and for float32 too; with ``interpret`` they run on any
    platform, in Pallas' interpret mode: how the CPU client tests them (slow; tiny shapes)."""
    token = _OVERRIDE.set((int(min_sequence), bool(interpret)))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


@contextlib.contextmanager
def sliding_window(window: int | None):
    """Inside, a boolean mask takes the kernels when it is causal within segments and within
    ``window`` positions (the query's own included): what a sliding-window model's masks are
    (module docstring). ``None`` changes nothing."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window <= 0):
        raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
    token = _WINDOW.set(window)
    try:
        yield
    finally:
        _WINDOW.reset(token)


def current_window() -> int | None:
    """The window of the innermost :func:`sliding_window`, or None."""
    return _WINDOW.get()


def interpreted(min_sequence: int = _LANES):
    """:func:`kernels` in Pallas' interpret mode, on any platform (tests)."""
    return kernels(min_sequence, interpret=True)


def lowering_key() -> tuple:
    """What decides this module's choices besides the arrays: part of the key of any cache
    of traced functions (a layer body traced for one device must not serve a partitioned
    program, nor an interpreted one a compiled one)."""
    per_shard_key = None
    if _PER_SHARD.get() is not None:
        mesh, batch_axes, head_axis = _PER_SHARD.get()
        per_shard_key = (tuple(dict(mesh.shape).items()), batch_axes, head_axis)
    return (_XLA_FORM.get(), _OVERRIDE.get(), _WINDOW.get(), per_shard_key,
            context_attention.lowering_key())


def is_interpreted() -> bool:
    override = _OVERRIDE.get()
    return override is not None and override[1]


def supported(query, key, value, attn_bias, is_causal, dropout_p=0.0) -> bool:
    """Does the rule of the module docstring send this call to the kernels (on a TPU)?"""
    override = _OVERRIDE.get()
    least = MIN_SEQUENCE if override is None else override[0]
    b, h, sq, d = query.shape
    sk = key.shape[2]
    return ((attn_bias is None or (not is_causal and may_be_document_mask(attn_bias, b, sq)))
            and not _may_drop(dropout_p) and sq == sk and sq >= least
            and sq % _LANES == 0 and kernels_take(query, key, value)
            and (_PER_SHARD.get() is None or _shard_specs(query, key) is not None))


def kernels_take(query, key, value) -> bool:
    """The part of :func:`supported`'s rule on heads and dtypes, whatever the lengths: the
    XLA form not forced, head_dim a multiple of 64 and the values' the same, whole groups of
    query heads per kv head, one dtype, bfloat16 (float32 too under :func:`kernels`)."""
    if _XLA_FORM.get():
        return False
    h, d = query.shape[1], query.shape[-1]
    kv_heads = key.shape[1]
    dtypes = (query.dtype, key.dtype, value.dtype)
    allowed = (jnp.bfloat16,) if _OVERRIDE.get() is None else (jnp.bfloat16, jnp.float32)
    return (d % _HEAD_DIM_MULTIPLE == 0 and value.shape[-1] == d
            and value.shape[1] == kv_heads and h % kv_heads == 0
            and len(set(dtypes)) == 1 and dtypes[0] in allowed)


def kernels_would_run(sequence: int, head_dim: int, *, bf16: bool) -> bool:
    """:func:`supported`'s rule on plain numbers, for a causal call without dropout on a TPU:
    would a step of ``sequence`` tokens per row, heads of ``head_dim``, computing in bf16 (or
    not) run the kernels? On one device, or per device over a mesh whose batch and head
    splits are even (:func:`per_shard`; a mesh the model's heads do not split over is refused
    before). The planner asks."""
    return (bf16 and sequence >= MIN_SEQUENCE and sequence % _LANES == 0
            and head_dim % _HEAD_DIM_MULTIPLE == 0)


def may_be_document_mask(mask, batch: int, sequence: int) -> bool:
    """Could ``mask`` be a document mask of ``batch`` rows of ``sequence`` tokens (boolean,
    one for all heads)? Whether it is one is decided in the program (:func:`document_segments`)."""
    shape = tuple(mask.shape)
    return (mask.dtype == jnp.bool_ and len(shape) == 4 and shape[0] in (1, batch)
            and shape[1] == 1 and shape[2:] == (sequence, sequence))


def document_segments(mask, batch: int, window: int | None = None):
    """``(segment_ids [B, S] int32, is_document)`` of a boolean mask ``[B or 1, 1, S, S]``:
    a segment starts at every query that may not see the key just before it, and
    ``is_document`` (a traced bool) says whether the mask is exactly causal-within-segments
    (and within ``window`` positions) for those ids, the mask the kernels then apply."""
    keep = jnp.broadcast_to(mask, (batch, 1) + tuple(mask.shape[2:]))[:, 0]
    sequence = keep.shape[-1]
    before = jnp.diagonal(keep, offset=-1, axis1=1, axis2=2)  # [B, S - 1]: may i see i - 1
    starts = jnp.concatenate([jnp.ones((batch, 1), jnp.bool_), ~before], axis=1)
    segments = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
    causal = jnp.tri(sequence, dtype=jnp.bool_)
    if window is not None:
        causal = causal & ~jnp.tri(sequence, k=-window, dtype=jnp.bool_)
    rebuilt = (segments[:, :, None] == segments[:, None, :]) & causal
    return segments, jnp.all(rebuilt == keep)


def for_document_mask(mask, batch: int, with_segments, otherwise):
    """``with_segments(segment_ids)`` where ``mask`` is a document mask (within the
    :func:`sliding_window`, if any), else ``otherwise()`` (both traced; the program runs one)."""
    segments, is_document = document_segments(mask, batch, _WINDOW.get())
    return jax.lax.cond(is_document, with_segments, lambda _: otherwise(), segments)


def on_tpu(operands: tuple, with_kernels, with_xla):
    """``with_kernels(*operands)`` where the program is lowered for a TPU (or interpreted, see
    :func:`kernels`), else ``with_xla(*operands)``: both are traced, the lowering keeps one.
    Where no TPU compiler is installed, nothing can be lowered for a TPU: only the XLA form is
    traced (the kernels' trace costs ~0.3 s per program)."""
    if is_interpreted():
        return with_kernels(*operands)
    if not _tpu_compiler_installed():
        return with_xla(*operands)
    return jax.lax.platform_dependent(*operands, tpu=with_kernels, default=with_xla)


@functools.lru_cache(maxsize=1)
def _tpu_compiler_installed() -> bool:
    """libtpu (the ``libtpu`` package, or a library JAX is pointed at): what a TPU runtime and
    a compile-only TPU target both need."""
    return importlib.util.find_spec("libtpu") is not None or bool(os.environ.get("TPU_LIBRARY_PATH"))


def _may_drop(dropout_p) -> bool:
    return not (isinstance(dropout_p, (int, float)) and dropout_p == 0)


def _block(sequence: int) -> int:
    return _BLOCK if sequence % _BLOCK == 0 else _LANES


@functools.lru_cache(maxsize=64)
def _kernel(sequence: int, group: int, is_causal: bool, interpret: bool,
            window: int | None = None):
    """The multi-query kernel for ``group`` query heads over one kv head, with host-side
    (NumPy) mask tables: no tracer and no device array is ever cached (module docstring).
    With ``window`` (causal only), a query sees itself and the ``window - 1`` keys before."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib, splash_attention_mask as mask_lib)

    shape = (sequence, sequence)
    if is_causal and window is not None:
        one = mask_lib.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    else:
        one = mask_lib.CausalMask(shape) if is_causal else mask_lib.FullMask(shape)
    block = _block(sequence)
    blocks = kernel_lib.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    with jax.ensure_compile_time_eval():  # concrete tables even when called inside a trace
        kernel = kernel_lib.make_splash_mqa_single_device(
            mask_lib.MultiHeadMask([one] * group), block_sizes=blocks, save_residuals=True,
            interpret=interpret)
    return jax.tree_util.tree_map(numpy.asarray, kernel)


def _scale(query, scale) -> float:
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)


def _grouped(x, kv_heads):
    b, h, s, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, s, d)


def _for_call(query, key, is_causal, window):
    b, h, s, _ = query.shape
    kv_heads = key.shape[1]
    return kv_heads, _kernel(s, h // kv_heads, bool(is_causal), is_interpreted(), window)


def kernel_grads(kernel, query, key, value, out, logsumexp, grad_out, segment_ids=None):
    """``(dq, dk, dv)`` of one multi-query ``kernel`` call (``query`` ``[group, S, D]``, already
    scaled) by the kernel library's own backward rule, given what its forward rule saves: q,
    k, v, segment ids, sinks, out, logsumexp and the kernel's dq and dkv mask tables."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib)

    settings = kernel.kwargs
    residuals = (query, key, value, segment_ids, None, out, logsumexp, kernel.dq_mask_info,
                 kernel.dkv_mask_info)
    grads = kernel_lib._splash_attention_bwd(
        False, settings["mask_value"], settings["is_mqa"], settings["block_sizes"], None,
        settings["mask_function"], settings["attn_logits_soft_cap"], settings["interpret"],
        residuals, grad_out)
    return grads[3:6]


def kernel_precision(dtype):
    """The precision of the kernels' own dots. bf16 operands (float32 accumulation: exact in
    one pass) at the default precision, whatever ``trainer.matmul_precision`` set for float32
    dots: a dot traced at ``highest`` becomes Mosaic's fp32 contract precision, which it cannot
    compile for bf16 operands ("Bad lhs type"). float32 operands (:func:`kernels` only) at the
    project's float32 matmul precision, as the XLA form's dots: at the default precision a TPU
    multiplies them in one bf16 pass (measured on a v5e: 1e-2 from PyTorch's float32 SDPA)."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision(matmul.jax_precision_name())
    return jax.default_matmul_precision("default")


def _segment_ids(segments):
    """The kernel's ``SegmentIds`` of one row's ``[S]`` ids (self-attention: the same for
    queries and keys), or None."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib)

    return None if segments is None else kernel_lib.SegmentIds(q=segments, kv=segments)


def forward(query, key, value, is_causal, scale, segments=None, window=None):
    """``(out [B, H, S, D], logsumexp [B, H, S] float32)`` by the forward kernel (see
    :func:`supported`); with ``segments`` ``[B, S]`` a token sees only its own segment, with
    ``window`` (causal) only the last ``window`` positions. Under :func:`per_shard`, each
    device runs it on its rows and heads."""
    def local(q, k, v, row_segments):
        return _forward(q, k, v, is_causal, scale, row_segments, window)

    return _on_shards(local, (query, key, value), segments, ("heads",) * 3,
                      ("heads", "rows_heads"), query, key)


def _forward(query, key, value, is_causal, scale, segments, window):
    """:func:`forward` on whole arrays."""
    b, h, s, d = query.shape
    kv_heads, kernel = _for_call(query, key, is_causal, window)
    scaled = (query.astype(jnp.float32) * _scale(query, scale)).astype(query.dtype)

    def one(q, k, v, row_segments):
        return kernel(q, k, v, segment_ids=_segment_ids(row_segments))

    per_row = None if segments is None else 0
    with kernel_precision(query.dtype):
        out, (logsumexp,) = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)),
                                     in_axes=(0, 0, 0, per_row))(
            _grouped(scaled, kv_heads), key, value, segments)
    return out.reshape(b, h, s, d).astype(query.dtype), logsumexp.reshape(b, h, s)


def backward(grad_out, query, key, value, out, logsumexp, is_causal, scale, segments=None,
             window=None):
    """``(dq, dk, dv)`` by the backward kernels, from the forward's output and logsumexp
    (and the forward's ``segments`` and ``window``); under :func:`per_shard`, per device."""
    def local(g, q, k, v, o, lse, row_segments):
        return _backward(g, q, k, v, o, lse, is_causal, scale, row_segments, window)

    return _on_shards(local, (grad_out, query, key, value, out, logsumexp), segments,
                      ("heads",) * 5 + ("rows_heads",), ("heads",) * 3, query, key)


def _backward(grad_out, query, key, value, out, logsumexp, is_causal, scale, segments, window):
    """:func:`backward` on whole arrays."""
    b, h, s, d = query.shape
    kv_heads, kernel = _for_call(query, key, is_causal, window)
    scale_value = _scale(query, scale)

    def one(q, k, v, o, lse, do, row_segments):
        return kernel_grads(kernel, q, k, v, o, lse, do, _segment_ids(row_segments))

    scaled = (query.astype(jnp.float32) * scale_value).astype(query.dtype)
    lse = logsumexp.astype(jnp.float32).reshape(b, kv_heads, h // kv_heads, s)
    with kernel_precision(query.dtype):
        grad_scaled, grad_key, grad_value = jax.vmap(
            jax.vmap(one, in_axes=(0,) * 6 + (None,)),
            in_axes=(0,) * 6 + (None if segments is None else 0,))(
            _grouped(scaled, kv_heads), key, value, _grouped(out.astype(query.dtype), kv_heads),
            lse, _grouped(grad_out.astype(query.dtype), kv_heads), segments)
    grad_query = (grad_scaled.astype(jnp.float32) * scale_value).astype(query.dtype)
    return grad_query.reshape(b, h, s, d), grad_key.astype(key.dtype), grad_value.astype(value.dtype)
