"""The SPMD sharding plan of a model family, derived from its table of parameter roles.

A family (:class:`tpu_train.models.ModelFamily`, handed down by the layer above: this layer
does not import ``models``) names each parameter's role by regex; every role has one layout
over the ``(data, fsdp, expert, context, tensor)`` mesh (on a mesh that splits sequences over
``context``, every ``fsdp`` split is also over ``context``: ``plans.over_context``):

==============  ========================================  =====================================
role            spec (in order of preference)             why
==============  ========================================  =====================================
``embedding``   ``((tensor, fsdp),)``, ``(tensor, fsdp)``  vocabulary-parallel rows
``column``      ``((tensor, fsdp),)``, ``(tensor, fsdp)``  outputs (heads, hidden units) split
``row``         ``(fsdp, tensor)``                        inputs split; partial sums reduced
``output``      ``((tensor, fsdp),)``, ``(tensor, fsdp)``  vocabulary-parallel logits
``replicated``  ``(fsdp,)``, ``()``                       small; sharded to keep FSDP uniform
``expert_*``    ``(expert, <column or row spec>)``        stacked ``[n_experts, out, in]``
                                                          experts: each device holds
                                                          ``n_experts / expert`` of them
==============  ========================================  =====================================

FSDP shards the leading dimension of every weight: the output dimension of column-parallel
weights (within each tensor shard) and the model width of row-parallel ones. Keeping the
shards on the leading dimension makes them contiguous blocks of the flat storage buffer (see
``flat_storage_sharding``). With Megatron-style column -> row pairs, each attention and MLP
block needs one reduction over ``tensor`` in the forward and one in the backward; XLA inserts
them from these specs. Every weight without an expert role is replicated over ``expert``;
the experts' weights are used where they are stored (``compute_sharding`` gathers ``fsdp``
only) and XLA moves the tokens to their experts' devices and back. Activations: the batch is
split over ``(data, fsdp, expert)``, heads and the
hidden widths the family names (:class:`ActivationRule`) over ``tensor``; the residual stream
is replicated on ``tensor``.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import PartitionSpec as P

from .mesh import BATCH_AXES
from .plans import PlanError, ShardingPlan

__all__ = ["DECODER_ACTIVATIONS", "ROLES", "ActivationRule", "role_specs", "sharding_plan"]

_B = BATCH_AXES
_U = P.UNCONSTRAINED

ROLES = ("embedding", "column", "row", "output", "replicated", "column_bias", "expert_column",
         "expert_row")

# Activation layouts of a decoder language model, by kind.
DECODER_ACTIVATIONS: dict[str, P] = {
    "tokens": P(_B, None),                  # [batch, seq] token ids and labels
    "hidden": P(_B, None, None),            # [batch, seq, dim] residual stream
    "heads": P(_B, "tensor", None, None),   # [batch, heads, seq, head_dim] q/k/v, scores
    "ffn": P(_B, None, "tensor"),           # [batch, seq, ffn_hidden_dim]
    "logits": P(_B, None, "tensor"),        # [batch, seq, vocab]
}


def role_specs(*, fsdp: bool = True, tensor: bool = True) -> dict[str, Any]:
    """``{role: spec or list of specs in order of preference}`` (module docstring)."""
    f = "fsdp" if fsdp else None
    t = "tensor" if tensor else None
    # Column-parallel weights keep both splits on their leading (output) dimension, tensor
    # major: the row-major blocks of the flat storage buffer are then exactly the plan's
    # shards, so reshaping the buffer to [out, in] inside a compiled step moves no data.
    # With FSDP on `in` instead, every weight needed an all-to-all at each edge of the step,
    # and XLA's CPU compile time grew with the device count (48.8 s for one Llama-3.1-8B
    # layer on 64 virtual devices, 2.5 s with this layout).
    # Where tensor x fsdp does not divide the rows (Llama 3's vocabulary, 128256 = 2^8 x 501,
    # over more than 256 chips), the plan falls back to FSDP on `in`.
    column = [P(tuple(a for a in (t, f) if a) or None, None), P(t, f)]
    # A column-parallel layer's bias (Qwen2's q/k/v) is split as its weight's rows.
    bias = [P(tuple(a for a in (t, f) if a) or None), P(t)]
    # Stacked experts [n_experts, out, in]: the expert dimension over `expert`, each expert's
    # matrix as above. A router's [n_experts, dim] weight (replicated) may not split over a
    # larger fsdp: whole then, as it is tiny.
    expert_column = [P("expert", *spec) for spec in column]
    return {"embedding": column, "column": column, "row": P(f, t), "output": column,
            "replicated": [P(f), P()], "column_bias": bias, "expert_column": expert_column,
            "expert_row": P("expert", f, t)}


def sharding_plan(family: Any, *, fsdp: bool = True, tensor: bool = True) -> ShardingPlan:
    """The plan of ``family`` (its ``name``, ``param_roles``, ``split_sizes(config)``);
    ``fsdp=False``/``tensor=False`` drop that axis from every spec.

    Dropping an axis is only needed to *keep parameters replicated* on a mesh whose axis is
    larger than 1 (e.g. ZeRO-1-like experiments); on a mesh where the axis has size 1 the full
    plan already degenerates to the smaller layout.
    """
    specs = role_specs(fsdp=fsdp, tensor=tensor)
    rules = []
    for pattern, role in family.param_roles:
        role = getattr(role, "value", role)
        if role not in specs:
            raise PlanError(f"family {family.name}: {pattern!r} has role {role!r}, which this "
                            f"version cannot shard; roles: {', '.join(ROLES)}")
        rules.append((pattern, specs[role]))
    # LoRA adapters (rank x in, out x rank) are small next to the frozen weight they adapt:
    # replicated, so their update needs no gather.
    rules.append((r"\.lora_[ab]$", P()))
    # An int8 weight's per-output-channel scales (tpu_train.models.lora): a few KB each.
    rules.append((r"\.weight_scale$", P()))
    acts = {k: P(*[(None if (e == "tensor" and not tensor) else e) for e in spec])
            for k, spec in DECODER_ACTIVATIONS.items()}
    name = f"{family.name}_plan" + ("" if fsdp and tensor else
                                    f"(fsdp={fsdp}, tensor={tensor})")

    def activation_rule(model, batch_shape, context: int = 1):
        config = getattr(model, "config", None)
        if config is None or len(batch_shape) != 2:
            return None  # not a decoder over [batch, seq] tokens: leave activations to XLA
        return ActivationRule(family.split_sizes(config), *batch_shape, tensor=tensor,
                              context=context)

    return ShardingPlan(rules, activations=acts, activation_rule=activation_rule, name=name)


class ActivationRule:
    """Pick an activation spec from an array's shape, for a traced graph without module names.

    A traced step only sees aten ops and shapes, so this classifies conservatively: a value
    whose leading dimension is the (micro-)batch, or batch x seq after a flatten, is split on
    the batch axes; a 4-D ``[batch, heads, ...]`` value also on ``tensor``; a last dimension
    equal to one of the family's hidden widths (feed-forward, vocabulary; when distinct from
    the model width) on ``tensor``. Every other dimension is left ``UNCONSTRAINED`` so a wrong
    guess never forces a reshard beyond the batch split. Returns ``None`` for anything else
    (weights, scalars). ``sizes``: the family's ``split_sizes(config)``.

    With ``context > 1`` (sequences split over the ``context`` axis) the first dimension after
    the batch (after the heads, for a 4-D value) of the sequence's length is split on
    ``context``; a flattened ``[batch * seq, ...]`` value is left to XLA, as no single spec
    of its leading dimension matches ``[batch, seq]`` split on both.
    """

    def __init__(self, sizes: Any, batch: int, seq_len: int, *, tensor: bool = True,
                 context: int = 1):
        self.sizes = sizes
        self.batch = int(batch)
        self.seq_len = int(seq_len)
        self.context = int(context)
        self._tensor = "tensor" if tensor else _U
        self._tensor_last = set(sizes.hidden.values()) - set(sizes.width.values())
        self._heads = set(sizes.heads.values())

    def __call__(self, shape) -> P | None:
        shape = tuple(shape)
        if len(shape) < 2:
            return None
        lead = shape[0]
        if lead not in (self.batch, self.batch * self.seq_len):
            return None
        if lead != self.batch and self.context > 1:
            return None
        rest = [_U] * (len(shape) - 1)
        heads = lead == self.batch and len(shape) == 4 and shape[1] in self._heads
        if heads:
            rest[0] = self._tensor
        elif shape[-1] in self._tensor_last:
            rest[-1] = self._tensor
        if self.context > 1:
            # rest[i] is shape[i + 1]; a 4-D value's heads come before its sequence
            sequence = [i for i in range(int(heads), len(rest)) if shape[i + 1] == self.seq_len]
            if sequence:
                rest[sequence[0]] = "context"
        return P(_B, *rest)
