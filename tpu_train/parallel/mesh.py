"""The SPMD device mesh: axes ``data``, ``fsdp``, ``expert``, ``context`` and ``tensor``, within
and across slices.

A mesh is a ``jax.sharding.Mesh`` whose axes are always, in this order:

* ``data``   — pure data parallelism: parameters replicated, the batch split;
* ``fsdp``   — fully sharded data parallelism: the batch split *and* parameters, gradients and
  optimizer state sharded (gathered per use by XLA);
* ``expert`` — expert parallelism (a mixture of experts): the batch split, and the experts'
  stacked weights split on their expert dimension; other weights replicated over it;
* ``context`` — context (sequence) parallelism: every sequence split over the axis, attention
  reading the keys and values of the whole sequence (``tpu_train.ops.context_attention``);
* ``tensor`` — tensor (model) parallelism: heads, the feed-forward hidden dimension and the
  vocabulary split.

The order goes from the least to the most communication-hungry axis, which is the order JAX's
mesh utilities expect: on a TPU slice :func:`jax.experimental.mesh_utils.create_device_mesh`
then places ``tensor`` on the tightest ICI rings. A multi-slice job (several slices joined by
the data-centre network, DCN) additionally splits ``data`` and/or ``fsdp`` across slices with
:func:`~jax.experimental.mesh_utils.create_hybrid_device_mesh`, so only the gradient
reduction (``data``) or the FSDP gathers (``fsdp``) cross DCN; ``tensor`` never does.

Degrees come from the ``parallel`` config section (``data``, ``fsdp``, ``expert``, ``context``,
``tensor``); one of ``data``/``fsdp``/``expert``/``tensor`` may be ``-1``, meaning "whatever is
left of the device count".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# The mesh axes a batch is split over: the compile layer's SPMD placement defines them.
from tpu_train.compile.spmd import BATCH_AXES

__all__ = [
    "AXES",
    "BATCH_AXES",
    "MeshError",
    "MeshShape",
    "build_mesh",
    "check_divisibility",
    "device_grid",
    "mesh_from_config",
    "resolve_mesh_shape",
]

AXES: tuple[str, ...] = ("data", "fsdp", "expert", "context", "tensor")


class MeshError(ValueError):
    """A mesh request that cannot be satisfied (bad degrees, or a model they do not divide)."""


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Resolved degrees of each axis.

    ``data``/``fsdp``/``expert``/``context``/``tensor`` are the total sizes of the mesh axes.
    ``dcn_data`` and ``dcn_fsdp`` say how many of those ways go across slices (DCN); the rest,
    the ICI degrees ``data // dcn_data`` etc., stay inside one slice (``expert``, ``context``
    and ``tensor`` always). ``sizes`` is in :data:`AXES` order.
    """

    data: int
    fsdp: int
    tensor: int
    dcn_data: int = 1
    dcn_fsdp: int = 1
    expert: int = 1
    context: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        """The degrees in :data:`AXES` order."""
        return (self.data, self.fsdp, self.expert, self.context, self.tensor)

    @property
    def ici(self) -> tuple[int, ...]:
        return (self.data // self.dcn_data, self.fsdp // self.dcn_fsdp, self.expert,
                self.context, self.tensor)

    @property
    def dcn(self) -> tuple[int, ...]:
        return (self.dcn_data, self.dcn_fsdp, 1, 1, 1)

    @property
    def num_devices(self) -> int:
        return self.data * self.fsdp * self.expert * self.context * self.tensor

    @property
    def num_slices(self) -> int:
        return self.dcn_data * self.dcn_fsdp

    @property
    def batch_shards(self) -> int:
        """Ways the global batch is split (it must be a multiple of this)."""
        return self.data * self.fsdp * self.expert

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _check_degree(name: str, value: Any, allow_infer: bool) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise MeshError(f"parallel.{name} must be an int, got {value!r}")
    value = int(value)
    if value == -1 and allow_infer:
        return value
    if value < 1:
        allowed = "a positive int or -1 (infer from the device count)" if allow_infer \
            else "a positive int"
        raise MeshError(f"parallel.{name} must be {allowed}, got {value}")
    return value


def resolve_mesh_shape(num_devices: int, data: int = -1, fsdp: int = 1, tensor: int = 1, *,
                       num_slices: int = 1, dcn_data: int | None = None,
                       dcn_fsdp: int = 1, expert: int = 1, context: int = 1) -> MeshShape:
    """Fill in a ``-1`` degree and check that the degrees multiply to ``num_devices``.

    ``num_slices > 1`` describes a multi-slice job; by default every slice boundary goes on
    the ``data`` axis (``dcn_data = num_slices / dcn_fsdp``), which only sends the gradient
    reduction over DCN. ``context`` (never inferred) splits every sequence within a slice.
    Raises :class:`MeshError` with the offending numbers otherwise.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise MeshError(f"the device count must be a positive int, got {num_devices!r}")
    degrees = {"data": _check_degree("data", data, True),
               "fsdp": _check_degree("fsdp", fsdp, True),
               "expert": _check_degree("expert", expert, True),
               "tensor": _check_degree("tensor", tensor, True)}
    inferred = [name for name, v in degrees.items() if v == -1]
    if len(inferred) > 1:
        raise MeshError(
            f"at most one of parallel.data/fsdp/expert/tensor may be -1 (inferred), got "
            f"{', '.join(f'{n}=-1' for n in inferred)}; set all but one explicitly")
    context = _check_degree("context", context, False)
    known = math.prod(v for v in degrees.values() if v != -1) * context
    if inferred:
        if num_devices % known:
            raise MeshError(
                f"cannot infer parallel.{inferred[0]}: the other degrees "
                f"{'' if context == 1 else f'(context={context} among them) '}multiply to "
                f"{known}, which does not divide the {num_devices} devices")
        degrees[inferred[0]] = num_devices // known
    product = math.prod(degrees.values()) * context
    if product != num_devices:
        names = ["data", "fsdp"] + (["expert"] if degrees["expert"] != 1 else []) + \
            ["tensor"]
        values = [degrees[a] for a in names]
        if context != 1:
            names, values = names + ["context"], values + [context]
        raise MeshError(
            f"parallel.{' * '.join(names)} = {' * '.join(map(str, values))} = {product}, but "
            f"there are {num_devices} devices; make the product equal the device count (or set "
            f"one degree to -1 to infer it)")

    num_slices = _check_degree("num_slices", num_slices, False)
    dcn_fsdp = _check_degree("dcn_fsdp", dcn_fsdp, False)
    if dcn_data is None:
        if num_slices % dcn_fsdp:
            raise MeshError(f"dcn_fsdp={dcn_fsdp} does not divide the {num_slices} slices")
        dcn_data = num_slices // dcn_fsdp
    dcn_data = _check_degree("dcn_data", dcn_data, False)
    if dcn_data * dcn_fsdp != num_slices:
        raise MeshError(
            f"dcn_data * dcn_fsdp = {dcn_data} * {dcn_fsdp} must equal the number of slices "
            f"({num_slices}); tensor parallelism never crosses slices")
    for axis, dcn in (("data", dcn_data), ("fsdp", dcn_fsdp)):
        if degrees[axis] % dcn:
            raise MeshError(
                f"parallel.{axis}={degrees[axis]} is not a multiple of its {dcn} cross-slice "
                f"(DCN) ways; each slice needs an equal share of the {axis} axis")
    return MeshShape(degrees["data"], degrees["fsdp"], degrees["tensor"], dcn_data, dcn_fsdp,
                     expert=degrees["expert"], context=context)


def check_divisibility(sizes: Any, shape: MeshShape) -> None:
    """Raise :class:`MeshError` if ``shape`` cannot shard a model of split ``sizes`` (a
    family's ``split_sizes(config)``: plain ints by the config field that sets them).

    Tensor parallelism splits the ``heads`` and ``hidden`` sizes, ``expert`` the ``experts``
    (a degree above 1 needs some); FSDP splits the model ``width`` of every weight or the
    output rows of column-parallel ones, whichever divides (:mod:`.family_plans`). Uneven shards are not padded: parameters are placed as global
    arrays, and ``jax.device_put`` requires every sharded dimension to divide evenly.
    """
    t, f = shape.tensor, shape.fsdp
    if t > 1:
        split = {**sizes.heads, **sizes.hidden}
        bad = [f"{name}={value}" for name, value in split.items() if value % t]
        if bad:
            raise MeshError(
                f"parallel.tensor={t} must divide every size it splits "
                f"({', '.join(split)}); it does not divide {', '.join(bad)}. Choose a tensor "
                f"degree that divides them all")
    (name, width), = sizes.width.items()
    if f > 1 and width % f:
        raise MeshError(
            f"parallel.fsdp={f} must divide the model width {name}={width}, the dimension "
            f"FSDP shards in every weight (no padding is applied)")
    e, experts = shape.expert, dict(getattr(sizes, "experts", None) or {})
    if e > 1 and not experts:
        raise MeshError(
            f"parallel.expert={e} splits a mixture of experts over devices, but this model "
            f"has no experts; set parallel.expert=1")
    bad = [f"{name}={value}" for name, value in experts.items() if value % e]
    if bad:
        raise MeshError(
            f"parallel.expert={e} must divide the model's {', '.join(bad)} (each device holds "
            f"1/{e} of the experts); choose a degree that divides them")


def _slice_count(devices: Sequence[Any]) -> int:
    indices = {getattr(d, "slice_index", 0) for d in devices}
    return len(indices)


def device_grid(shape: MeshShape, devices: Sequence[Any]) -> np.ndarray:
    """Arrange ``devices`` as a ``(data, fsdp, expert, context, tensor)`` array in topology
    order.

    On TPU, JAX's mesh utilities map the logical axes onto the physical torus (the ``tensor``
    axis on the fastest links); across slices, the hybrid variant keeps each slice a
    contiguous block along the DCN axes. Other platforms keep JAX's device order.
    """
    from jax.experimental import mesh_utils

    devices = list(devices)
    if len(devices) != shape.num_devices:
        raise MeshError(f"the mesh {shape.sizes} needs {shape.num_devices} devices, "
                        f"got {len(devices)}")
    if shape.num_slices > 1:
        found = _slice_count(devices)
        if found != shape.num_slices:
            raise MeshError(
                f"the mesh spans {shape.num_slices} slices over DCN but the devices belong to "
                f"{found} slice(s) (device.slice_index)")
        return mesh_utils.create_hybrid_device_mesh(list(shape.ici), list(shape.dcn), devices)
    if devices[0].platform == "tpu":
        # allow_split_physical_axes: e.g. fsdp=2 x tensor=2 on a 2x2x1 v5e-4 still maps.
        return mesh_utils.create_device_mesh(list(shape.sizes), devices,
                                             allow_split_physical_axes=True)
    return np.asarray(devices, dtype=object).reshape(shape.sizes)


def build_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, *,
               devices: Sequence[Any] | None = None, dcn_data: int | None = None,
               dcn_fsdp: int = 1, split_sizes: Any = None, expert: int = 1, context: int = 1):
    """Make the ``(data, fsdp, expert, context, tensor)`` :class:`jax.sharding.Mesh` over
    ``devices``.

    ``devices`` defaults to ``jax.devices()`` (every device of every process). The number of
    slices is read from the devices' ``slice_index``; ``split_sizes`` (a model family's
    ``split_sizes(config)``), if given, is checked with :func:`check_divisibility`.
    """
    import jax

    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise MeshError("no devices to build a mesh from")
    shape = resolve_mesh_shape(len(devices), data, fsdp, tensor,
                               num_slices=_slice_count(devices), dcn_data=dcn_data,
                               dcn_fsdp=dcn_fsdp, expert=expert, context=context)
    if split_sizes is not None:
        check_divisibility(split_sizes, shape)
    return jax.sharding.Mesh(device_grid(shape, devices), AXES)


def mesh_from_config(parallel: Any, split_sizes: Any = None, devices=None):
    """:func:`build_mesh` from the ``parallel`` config section (a mapping or an object).

    Optional keys ``context``, ``dcn_data`` and ``dcn_fsdp`` are honoured when present.
    """
    get = parallel.get if isinstance(parallel, Mapping) else \
        (lambda key, default=None: getattr(parallel, key, default))
    return build_mesh(get("data", -1), get("fsdp", 1), get("tensor", 1), devices=devices,
                      dcn_data=get("dcn_data", None), dcn_fsdp=get("dcn_fsdp", 1) or 1,
                      split_sizes=split_sizes, expert=get("expert", 1),
                      context=get("context", 1) or 1)

