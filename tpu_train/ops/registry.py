"""The aten → JAX lowering table shared by eager execution and the compiled step.

A *lowering* is a plain function that computes one aten op on JAX arrays. It mirrors the
aten schema of the op it lowers:

* every ``Tensor`` argument arrives as a ``jax.Array`` (``Tensor?`` may be ``None``,
  ``Tensor[]`` is a list of arrays). PyTorch passes Python numbers in Tensor slots
  (``x + 2`` reaches ``add.Tensor(x, 2)``); callers turn those into weakly typed 0-dim
  arrays with :func:`scalars_as_arrays`, so the lowering sees arrays and JAX's weak typing
  matches torch's treatment of such "wrapped numbers";
* ``ScalarType`` / ``Layout`` / ``Device`` / ``MemoryFormat`` arguments stay torch objects
  (see :mod:`tpu_train.ops.dtypes` for the dtype mapping);
* ``int`` / ``int[]`` / ``bool`` / ``str`` arguments are Python values (static);
* ``float`` and ``Scalar`` arguments holding a Python ``float`` may be JAX tracers in eager
  mode (so that a learning rate that changes every step does not recompile), so a lowering
  must never branch in Python on a float's value;
* it returns a ``jax.Array`` or a tuple of them, in the order of the schema's returns.

The caller casts each result to the dtype PyTorch's own meta kernels predict, so a lowering
may compute in a wider type; it must get the *shape* right.

Lowerings are registered for functional (non-mutating) overloads only. In-place and ``out=``
variants are derived by the device layer: it runs the functional overload and writes the
result into the mutated tensor (that is what keeps PyTorch's aliasing semantics).
View ops are lowered with value semantics (a view is a reshape / slice / transpose of the
value); eager mode handles their aliasing through storage geometry, the compiled step uses
these lowerings directly.

A lowering that must see float arguments as Python values (because they select an algorithm,
e.g. a norm's ``ord``) is registered with ``static_floats=True``.

Random ops take the PRNG key as a keyword argument ``rng_key`` (a ``jax.random`` key) and are
registered with ``random=True``; the caller supplies a fresh key per call.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Union

import torch

aten = torch.ops.aten

OpLike = Union[torch._ops.OpOverload, torch._ops.OpOverloadPacket]


@dataclasses.dataclass(frozen=True)
class Lowering:
    op: torch._ops.OpOverload
    fn: Callable
    random: bool = False
    static_floats: bool = False
    # For an op that draws random numbers only with some arguments (attention's dropout):
    # ``random_if(args, kwargs)`` says whether this call does; None: every call does.
    random_if: Callable | None = None

    def draws_random(self, args, kwargs) -> bool:
        """Does this call need a PRNG key? (A compiled program whose ops need none takes none.)"""
        return self.random and (self.random_if is None or bool(self.random_if(args, kwargs)))


_TABLE: dict[torch._ops.OpOverload, Lowering] = {}
# Called after every registration: callers that cache what they derived from the table (the
# eager device's per-op classification and compiled executables) drop it.
_LISTENERS: list[Callable[[], None]] = []


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` whenever a lowering is registered or replaced."""
    _LISTENERS.append(listener)


def _overloads(op: OpLike) -> Iterable[torch._ops.OpOverload]:
    if isinstance(op, torch._ops.OpOverloadPacket):
        for name in op.overloads():
            yield getattr(op, name)
    else:
        yield op


def lowers(*ops: OpLike, random: bool = False, static_floats: bool = False,
           override: bool = False, random_if: Callable | None = None):
    """Register the decorated function as the lowering of ``ops``.

    Passing a packet (``aten.add``) registers every overload of it; pass overloads
    (``aten.add.Tensor``) to be specific. Registering an overload twice is an error unless
    ``override=True``: two files silently fighting over one op is a bug. ``random_if``: see
    :attr:`Lowering.random_if`.
    """

    def register(fn: Callable) -> Callable:
        for op in ops:
            for overload in _overloads(op):
                if _is_mutating(overload) and isinstance(op, torch._ops.OpOverloadPacket):
                    # A packet such as aten.add also holds add.out / add_.Tensor-like overloads:
                    # those are derived by the device layer, never lowered directly.
                    continue
                if overload in _TABLE and not override:
                    raise ValueError(
                        f"{overload} already lowered by {_TABLE[overload].fn.__module__}."
                        f"{_TABLE[overload].fn.__name__}; pass override=True to replace it")
                _TABLE[overload] = Lowering(overload, fn, random, static_floats, random_if)
        for listener in _LISTENERS:
            listener()
        return fn

    return register


def get_lowering(op: torch._ops.OpOverload) -> Lowering | None:
    return _TABLE.get(op)


def lowered_ops() -> list[torch._ops.OpOverload]:
    return sorted(_TABLE, key=str)


def lowering_count() -> int:
    """How many overloads have a lowering (it only grows: a cache key for derived tables)."""
    return len(_TABLE)


def _is_mutating(op: torch._ops.OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def _is_tensor_slot(argument) -> bool:
    return str(argument.type) in ("Tensor", "Optional[Tensor]")


def scalars_as_arrays(op: torch._ops.OpOverload, args: tuple, kwargs: dict):
    """Replace Python numbers passed in ``Tensor`` slots of ``op`` by weak 0-dim arrays."""
    import jax.numpy as jnp

    def convert(value):
        if isinstance(value, (bool, int, float, complex)):
            return jnp.asarray(value)
        return value

    arguments = op._schema.arguments
    new_args = list(args)
    for i, (argument, value) in enumerate(zip(arguments, args)):
        if _is_tensor_slot(argument):
            new_args[i] = convert(value)
    new_kwargs = dict(kwargs)
    for argument in arguments:
        if argument.name in new_kwargs and _is_tensor_slot(argument):
            new_kwargs[argument.name] = convert(new_kwargs[argument.name])
    return tuple(new_args), new_kwargs


def is_mutating(op: torch._ops.OpOverload) -> bool:
    """True for in-place and ``out=`` overloads (any argument the schema marks as written)."""
    return _is_mutating(op)
