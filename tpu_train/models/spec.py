"""A model family's seam: one value that says what the layers around a model need of it.

The trainer, the parallel plans, the planner and the compiled step never name a family; they
ask its :class:`ModelFamily`:

* **configs and building**: the named configurations (``config_class`` instances), ``build``
  (the module, on the current default device: ``meta`` for a cheap skeleton) and
  ``init_weights`` (seeded initialization, materializing it on a device), and optionally
  ``initial_values`` (the same values piece by piece, for a caller that stores each as it
  comes);
* **the Hugging Face format** (:class:`HfFormat`): which ``config.json`` model types it reads,
  and how it loads and saves such a directory;
* **the blocks**: the repeated decoder blocks (FSDP's units, the stack the compiled step scans,
  what activation checkpointing recomputes, and later pipeline cut points), and the module
  paths of each block's q, k and v projections (what ``trainer.remat=save_qkv_proj`` keeps);
* **one table of parameter roles** (:class:`Role`, by regex on parameter names), from which
  the parallel layer derives both the SPMD shardings and the per-device DTensor plan;
* **the sizes each mesh axis splits** (:class:`SplitSizes`, plain ints by config field) for
  the divisibility checks, ``param_shapes`` and ``flops_per_token`` for the planner and MFU.

This module imports no torch: the command line checks ``model.name`` against the registry
(:mod:`tpu_train.models.registry`) before torch is imported.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["HfFormat", "ModelFamily", "Role", "SplitSizes"]


class Role(str, enum.Enum):
    """How tensor parallelism splits a weight (FSDP shards the leading dimension of every one).

    Weights are stored the PyTorch way, ``[out_features, in_features]``.
    """

    EMBEDDING = "embedding"    # [vocab, dim] lookup table: vocabulary rows split
    COLUMN = "column"          # [out, in]: outputs split (heads, hidden units)
    ROW = "row"                # [out, in]: inputs split; outputs are partial sums, all-reduced
    OUTPUT = "output"          # [vocab, dim] logits head: vocabulary split, gathered for the loss
    REPLICATED = "replicated"  # whole on every tensor rank (norm weights)
    COLUMN_BIAS = "column_bias"  # [out] bias of a column-parallel layer: split as its rows
    # Stacked expert weights [n_experts, out, in] (a mixture of experts): the experts split
    # over devices, and each expert's matrix as a column- or row-parallel weight.
    EXPERT_COLUMN = "expert_column"
    EXPERT_ROW = "expert_row"


@dataclasses.dataclass(frozen=True)
class SplitSizes:
    """The sizes the mesh axes split, as plain ints keyed by the config field that sets them.

    ``width``: the model width, FSDP's dimension in every weight and the width of the residual
    stream (one entry). ``heads``: what ``tensor`` splits in attention activations
    ``[batch, heads, seq, head_dim]``. ``hidden``: the other widths ``tensor`` splits, on the
    last dimension of activations (feed-forward hidden units, vocabulary). ``experts``: what
    ``expert`` splits (a mixture's expert count; none for a dense model).
    """

    width: Mapping[str, int]
    heads: Mapping[str, int]
    hidden: Mapping[str, int]
    experts: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.width) != 1:
            raise ValueError(f"SplitSizes.width names one size (the model width), got "
                             f"{dict(self.width)}")


@dataclasses.dataclass(frozen=True)
class HfFormat:
    """A family's Hugging Face checkpoint format.

    ``model_types``: the ``config.json`` ``model_type`` values it reads. ``read_config(dir)``
    gives ``(the config.json dict, the family's config)``; ``load(dir, dtype=, device=,
    max_seq_len=)`` the model with its weights (``max_seq_len``: None, the checkpoint's own); ``save(model, dir, bos_token_id=, eos_token_id=, pad_token_id=,
    state_dict=)`` writes a directory ``transformers`` loads. ``read_weights(dir, params)``
    (optional) yields its tensors one at a time, ``(parameter name, index along the first
    dimension or None, tensor)``, checked against ``params`` (name -> tensor of the expected
    shape): for a caller that stores each as it is read (an int8 base quantizes them).
    """

    model_types: tuple[str, ...]
    read_config: Callable[..., tuple[dict, Any]]
    load: Callable[..., Any]
    save: Callable[..., None]
    read_weights: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """Everything the layers around a model ask of its family (module docstring).

    The family's models carry their config as ``model.config`` (an instance of
    ``config_class``): that is how a model is traced back to its family.
    """

    name: str
    config_class: type
    configs: Mapping[str, Any]
    build: Callable[[Any], Any]
    init_weights: Callable[[Any, int, Any], Any]
    blocks: Callable[[Any], Any]
    param_roles: tuple[tuple[str, Role], ...]
    split_sizes: Callable[[Any], SplitSizes]
    param_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    flops_per_token: Callable[[Any, int], int]
    qkv_projections: tuple[str, str, str] | None = None
    localize_tensor_parallel: Callable[[Any, int], None] | None = None
    hf: HfFormat | None = None
    # ``initial_values(config, [(name, shape)], seed)``: what ``init_weights`` writes, one piece
    # at a time as ``(name, rows slice or None, float32 value)`` (optional).
    initial_values: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name or ""):
            raise ValueError(f"a model family's name is lower-case letters, digits and _, got "
                             f"{self.name!r}")
        roles = []
        for pattern, role in self.param_roles:
            try:
                re.compile(pattern)
                roles.append((pattern, Role(role)))
            except re.error as err:
                raise ValueError(f"family {self.name}: bad parameter regex {pattern!r}: "
                                 f"{err}") from None
            except ValueError:
                raise ValueError(f"family {self.name}: {role!r} (for {pattern!r}) is not a "
                                 f"parameter role; roles: "
                                 f"{', '.join(r.value for r in Role)}") from None
        object.__setattr__(self, "param_roles", tuple(roles))
        wrong = sorted(n for n, c in self.configs.items() if not isinstance(c, self.config_class))
        if wrong:
            raise ValueError(f"family {self.name}: configs {wrong} are not "
                             f"{self.config_class.__name__} instances")
        if self.qkv_projections is not None and len(self.qkv_projections) != 3:
            raise ValueError(f"family {self.name}: qkv_projections names the q, k and v "
                             f"projections (3 module paths), got {self.qkv_projections!r}")

    def config(self, name: str, **overrides) -> Any:
        """The named configuration, with fields replaced by ``overrides``."""
        if name not in self.configs:
            raise KeyError(f"unknown {self.name} config {name!r}; valid names are: "
                           f"{', '.join(sorted(self.configs))}")
        config = self.configs[name]
        if overrides:
            valid = {f.name for f in dataclasses.fields(config)}
            unknown = sorted(set(overrides) - valid)
            if unknown:
                raise TypeError(f"unknown {type(config).__name__} field(s) {unknown}; valid "
                                f"fields are: {', '.join(sorted(valid))}")
            config = dataclasses.replace(config, **overrides)
        return config

    def role_of(self, param_name: str) -> Role | None:
        """The role of the first regex that searches ``param_name`` (None: no role)."""
        for pattern, role in self.param_roles:
            if re.search(pattern, param_name):
                return role
        return None

    def num_params(self, config: Any) -> int:
        """Distinct parameters (a tied weight counted once, as ``param_shapes`` lists it)."""
        return sum(math.prod(shape) for shape in self.param_shapes(config).values())
