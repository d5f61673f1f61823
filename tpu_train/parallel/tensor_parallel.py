"""Tensor parallelism of ``tpu_train.models.Llama`` for the per-device world (DTensor).

The per-device counterpart of :mod:`.llama_plan` (which gives SPMD ``PartitionSpec``s): a
``parallelize_module`` plan with torch's ``ColwiseParallel`` / ``RowwiseParallel`` styles,
Megatron-style, as torchtitan applies it to Llama:

==============================  ==========================================================
module                          style (and why)
==============================  ==========================================================
``tok_embeddings``              Rowwise: vocabulary rows split, output all-reduced to a
                                replicated residual stream (kept replicated when tied)
``attention.w{q,k,v}``          Colwise: each rank computes its share of the heads
``attention.wo``                Rowwise: partial sums over heads, all-reduced
``feed_forward.w{1,3}``         Colwise: hidden units split
``feed_forward.w2``             Rowwise
``output``                      Colwise with a replicated (all-gathered) result, so an
                                ordinary ``cross_entropy`` on the logits works
``*norm``                       not planned: replicated plain parameters
==============================  ==========================================================

No sequence parallelism: it would split the residual stream on the sequence dimension and so
require every batch's sequence length to divide ``tensor``; norms and the residual stream stay
replicated over ``tensor`` instead, as in :mod:`.llama_plan`.

``Attention`` reshapes q/k/v with its ``n_heads`` / ``n_kv_heads`` attributes (read from the
config at construction, not ``view(-1)``), so after the split each block's attention is told
its local head counts, as torchtitan did for its Llama; the grouped-query ratio is unchanged.
The model file itself stays free of parallel code. A parallelized model is for training: its
KV cache (sized from the config) does not match the local head counts.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

__all__ = ["apply_llama_tp", "llama_tp_plan"]


def llama_tp_plan(model: nn.Module) -> dict:
    """The ``parallelize_module`` plan (fully qualified module name -> style) for ``model``."""
    plan: dict = {}
    tied = getattr(model, "output", None) is None
    if not tied:
        # With tied embeddings the logits are F.linear(h, tok_embeddings.weight) with a plain
        # h: a vocabulary-sharded DTensor weight cannot meet it, so the table stays whole.
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    for i, _ in enumerate(model.layers):
        prefix = f"layers.{i}."
        plan.update({
            prefix + "attention.wq": ColwiseParallel(),
            prefix + "attention.wk": ColwiseParallel(),
            prefix + "attention.wv": ColwiseParallel(),
            prefix + "attention.wo": RowwiseParallel(),
            prefix + "feed_forward.w1": ColwiseParallel(),
            prefix + "feed_forward.w3": ColwiseParallel(),
            prefix + "feed_forward.w2": RowwiseParallel(),
        })
    return plan


def apply_llama_tp(model: nn.Module, tp_mesh) -> None:
    """Shard ``model`` (a Llama) over the 1-D ``tp_mesh`` and localize the head counts."""
    tp = tp_mesh.size()
    parallelize_module(model, tp_mesh, llama_tp_plan(model))
    for block in model.layers:
        attention = block.attention
        # Divisibility was checked against the config before sharding (check_model_divisibility).
        attention.n_heads //= tp
        attention.n_kv_heads //= tp
