"""Sharding plans: parameter names → ``PartitionSpec``s over the ``(data, fsdp, tensor)`` mesh.

A :class:`ShardingPlan` is an ordered list of ``(regex, PartitionSpec)`` rules matched against
parameter names (``module.named_parameters()`` names), plus named activation specs. It lives
apart from the model: the model code never mentions devices or meshes, and the same plan
serves every layout, because sharding over a mesh axis of size 1 is a no-op (FSDP only, TP
only, FSDP x TP and plain data parallelism are all one plan on differently shaped meshes).

Parameters are placed as global ``jax.Array``s (``jax.device_put`` with a ``NamedSharding``),
so ``array.sharding`` and ``array.addressable_shards`` show where each piece lives. Gradients
and optimizer moments take their parameter's sharding (:meth:`ShardingPlan.state_shardings`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec, get_abstract_mesh

# Defined by the compile layer, which raises it too when a plan does not fit a step.
from tpu_train.compile.spmd import PlanError

__all__ = [
    "PlanError",
    "ShardingPlan",
    "constrain",
    "over_context",
    "per_device_bytes",
]


def _shape_of(value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", None)
    if shape is None:
        raise PlanError(f"expected an array or tensor with a .shape, got {type(value).__name__}")
    return tuple(int(s) for s in shape)


def over_context(spec: PartitionSpec, mesh_shape: Mapping[str, int]) -> PartitionSpec:
    """``spec`` with every ``fsdp`` split also over ``context`` where the mesh (its axes'
    sizes, ``mesh_shape``) splits sequences
    (``context > 1``): a chip holding a ``1 / context`` share of each sequence needs only that
    share of the weights between their uses, as FSDP's; a weight is gathered whole over both
    where it is used (``tpu_train.compile.spmd.GATHERED_AXES``) and its gradient, a sum over
    every token of the step, is reduced and split over both. Else ``spec`` unchanged."""
    if int(dict(mesh_shape).get("context", 1)) == 1:
        return spec

    def widened(entry):
        axes = _axes_of(entry)
        if "fsdp" not in axes or "context" in axes:
            return entry
        at = axes.index("fsdp") + 1
        return axes[:at] + ("context",) + axes[at:]

    return PartitionSpec(*(widened(e) for e in spec))


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


class ShardingPlan:
    """Ordered ``(regex, PartitionSpec)`` rules; the first rule whose regex *searches* a name wins.

    Args:
        rules: ``(pattern, spec)`` pairs. Patterns are matched with ``re.search``, so anchor
            them (``(^|\\.)norm\\.weight$``) to tolerate wrapper prefixes such as ``_orig_mod.``.
            ``spec`` may be a list of specs in order of preference: a mesh gets the first one
            that splits the parameter evenly (``spec_for`` names the first).
        activations: named activation specs (e.g. ``"hidden"``), for :func:`constrain`.
        activation_rule: ``(model, batch_shape) -> rule or None``, where ``rule(shape)`` gives
            the spec of an intermediate value of that shape (or ``None``: left to XLA). The
            compiled SPMD step pins every intermediate the rule names to that spec; a traced
            step only sees shapes, so the rule classifies by shape.
        default: spec for names no rule matches; ``None`` (the default) makes an unmatched
            name an error, so a new parameter is never silently replicated.
        name: shown in messages and :meth:`describe`.
    """

    def __init__(self, rules: Sequence[tuple[str, PartitionSpec]], *,
                 activations: Mapping[str, PartitionSpec] | None = None,
                 activation_rule: Callable[[Any, tuple], Any] | None = None,
                 default: PartitionSpec | None = None, name: str = "plan"):
        self.name = name
        self.rules: list[tuple[re.Pattern, PartitionSpec]] = []
        self._options: list[tuple[PartitionSpec, ...]] = []  # per rule, in preference order
        for pattern, spec in rules:
            options = tuple(spec) if isinstance(spec, list) else (spec,)
            if not options or not all(isinstance(o, PartitionSpec) for o in options):
                raise PlanError(f"{name}: rule {pattern!r} needs a PartitionSpec (or a list of "
                                f"them, in order of preference), got {spec!r}")
            try:
                self.rules.append((re.compile(pattern), options[0]))
                self._options.append(options)
            except re.error as err:
                raise PlanError(f"{name}: bad regex {pattern!r}: {err}") from None
        self.activations = dict(activations or {})
        self.activation_rule = activation_rule
        self.default = default

    # -- specs -------------------------------------------------------------------------------

    def spec_for(self, name: str, shape: Sequence[int] | None = None) -> PartitionSpec:
        """The spec of parameter ``name``; with ``shape``, also check the spec's rank fits."""
        for regex, spec in self.rules:
            if regex.search(name):
                break
        else:
            if self.default is None:
                raise PlanError(
                    f"{self.name}: no rule matches parameter {name!r}; add a rule for it or "
                    f"build the plan with default=PartitionSpec() to replicate such parameters")
            spec = self.default
        if shape is not None and len(spec) > len(shape):
            raise PlanError(f"{self.name}: spec {spec} for {name!r} has {len(spec)} entries but "
                            f"the parameter has shape {tuple(shape)}")
        return spec

    def specs(self, named: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> dict[str, PartitionSpec]:
        """``{name: spec}`` for ``named_parameters()``-style pairs or a ``{name: array}`` map."""
        items = named.items() if isinstance(named, Mapping) else named
        return {n: self.spec_for(n, _shape_of(v)) for n, v in items}

    def activation(self, kind: str) -> PartitionSpec:
        if kind not in self.activations:
            raise PlanError(f"{self.name}: no activation spec {kind!r}; known: "
                            f"{', '.join(sorted(self.activations)) or 'none'}")
        return self.activations[kind]

    # -- shardings and placement -------------------------------------------------------------

    def sharding_for(self, name: str, shape: Sequence[int], mesh) -> NamedSharding:
        """The ``NamedSharding`` of one parameter, checked against ``mesh``.

        Every sharded dimension must divide evenly by the product of its mesh axes: global
        arrays are not padded, and a clear error here beats XLA's at the first step.
        """
        shape = tuple(int(s) for s in shape)
        first = self.spec_for(name, shape)
        options = next((o for (regex, _), o in zip(self.rules, self._options)
                        if regex.search(name)), (first,))
        options = [*(over_context(o, mesh.shape) for o in options
                     if over_context(o, mesh.shape) != o), *options]
        for spec in options[:-1]:  # a preferred layout that this mesh cannot split evenly
            try:
                return self._checked(name, shape, spec, mesh)
            except PlanError:
                continue
        return self._checked(name, shape, options[-1], mesh)

    def _checked(self, name: str, shape: tuple[int, ...], spec: PartitionSpec,
                 mesh) -> NamedSharding:
        if len(spec) > len(shape):
            raise PlanError(f"{self.name}: spec {spec} for {name!r} has {len(spec)} entries but "
                            f"the parameter has shape {shape}")
        for dim, entry in enumerate(spec):
            axes = _axes_of(entry)
            unknown = [a for a in axes if a not in mesh.shape]
            if unknown:
                raise PlanError(f"{self.name}: {name!r} is sharded over {unknown}, which the "
                                f"mesh {dict(mesh.shape)} does not have")
            ways = math.prod(mesh.shape[a] for a in axes)
            if ways > 1 and shape[dim] % ways:
                raise PlanError(
                    f"{self.name}: {name!r} dimension {dim} (size {shape[dim]}) is split "
                    f"{ways} ways over {axes} (spec {spec}) and does not divide evenly; change "
                    f"the mesh degrees (no padding is applied to parameters)")
        return NamedSharding(mesh, spec)

    def shardings(self, named: Iterable[tuple[str, Any]] | Mapping[str, Any],
                  mesh) -> dict[str, NamedSharding]:
        """``{name: NamedSharding}`` for ``model.named_parameters()`` (or any name → array map)."""
        items = named.items() if isinstance(named, Mapping) else named
        return {n: self.sharding_for(n, _shape_of(v), mesh) for n, v in items}

    def state_shardings(self, param_shardings: Mapping[str, NamedSharding],
                        state: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, NamedSharding]]:
        """Shardings of per-parameter optimizer state ``{param: {slot: array}}``.

        A slot shaped like its parameter (AdamW's ``exp_avg``/``exp_avg_sq``) is sharded like
        it, so FSDP shards optimizer state too; scalar slots (``step``) are replicated.
        """
        out: dict[str, dict[str, NamedSharding]] = {}
        for pname, slots in state.items():
            if pname not in param_shardings:
                raise PlanError(f"{self.name}: optimizer state for unknown parameter {pname!r}")
            ps = param_shardings[pname]
            out[pname] = {}
            for slot, value in slots.items():
                shape = _shape_of(value)
                out[pname][slot] = ps if len(shape) >= len(ps.spec) and shape else \
                    NamedSharding(ps.mesh, PartitionSpec())
        return out

    def place(self, arrays: Mapping[str, Any], mesh) -> dict[str, jax.Array]:
        """``jax.device_put`` every array with its plan sharding; returns global ``jax.Array``s.

        Accepts ``jax.Array``s, NumPy arrays, and CPU torch tensors (converted via NumPy).
        """
        shardings = self.shardings(arrays, mesh)
        placed = {}
        for n, value in arrays.items():
            if hasattr(value, "detach") and hasattr(value, "numpy"):  # a CPU torch tensor
                value = _torch_to_numpy(value)
            placed[n] = jax.device_put(value, shardings[n])
        return placed

    def describe(self, named: Iterable[tuple[str, Any]] | Mapping[str, Any], mesh=None) -> str:
        """One line per parameter: name, shape, spec (and per-device shape given a mesh)."""
        items = dict(named.items() if isinstance(named, Mapping) else named)
        rows = []
        for n, spec in self.specs(items).items():
            shape = _shape_of(items[n])
            local = shape
            if mesh is not None:
                padded = tuple(spec) + (None,) * (len(shape) - len(spec))
                local = tuple(s // math.prod(mesh.shape[a] for a in _axes_of(e))
                              for s, e in zip(shape, padded))
            rows.append(f"{n:<48} {str(shape):<16} {str(spec):<36} per-device {local}")
        return "\n".join(rows)


def _torch_to_numpy(tensor):
    """A CPU torch tensor as a NumPy array of the same dtype (bfloat16 via its bit pattern)."""
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16; JAX's ml_dtypes does
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def constrain(x, spec: PartitionSpec | None, mesh=None):
    """Pin the layout of activation ``x`` inside a jitted function (a no-op without a mesh).

    ``mesh=None`` uses the mesh set by ``jax.sharding.use_mesh``/``with mesh:`` if any; with
    no mesh at all (single-device runs) ``x`` is returned unchanged, so model-side code can
    call it unconditionally. Dimensions left ``PartitionSpec.UNCONSTRAINED`` stay free for
    XLA's propagation.
    """
    if spec is None:
        return x
    if mesh is None:
        abstract = get_abstract_mesh()
        if abstract is None or abstract.empty:
            return x
        return jax.lax.with_sharding_constraint(x, spec)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def per_device_bytes(arrays: Iterable[Any] | Mapping[str, Any]) -> dict[Any, int]:
    """Bytes each device holds of ``arrays`` (``jax.Array``s), from their addressable shards."""
    values = arrays.values() if isinstance(arrays, Mapping) else arrays
    totals: dict[Any, int] = {}
    for array in jax.tree_util.tree_leaves(list(values)):
        for shard in array.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return totals
