"""Collectives as jitted JAX programs over a 1-D mesh of a group's devices.

Each rank contributes one flat local block; a ``shard_map`` over the group's mesh runs the
collective (``psum``, ``all_gather``, ``psum_scatter``, ``all_to_all``, ``ppermute``) and each
rank reads back its own output block. On the CPU client XLA carries these over gloo, on TPU over
ICI. Only the group's processes take part: a program whose mesh holds some processes' devices is
run by those processes alone (measured: concurrent collectives of disjoint subgroups of a
4-process world complete and agree), so a torch subgroup is simply a smaller mesh.

Programs are cached per (group mesh, kind, static parameters); jit caches per shape and dtype.

The formulation of a sum-scatter depends on the platform. XLA's CPU client runs ``psum_scatter``
as a copy of the whole input followed by gloo's halving-doubling reduce-scatter, about twice as
slow as exchanging the chunks with ``all_to_all`` and summing them locally (measured with 2 and
4 processes, 16-64 MB: see docs/distributed.md); both move (n-1)/n of the buffer per rank. On
TPU and GPU, ``psum_scatter`` is the backend's native reduce-scatter and is kept.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax import shard_map as _shard_map

AXIS = "ranks"

# Reductions that XLA does natively across devices, and the element-wise rest, which run as
# all_gather/all_to_all + a local reduction over the rank axis.
NATIVE = {"sum": jax.lax.psum, "min": jax.lax.pmin, "max": jax.lax.pmax}
ELEMENTWISE = {
    "sum": operator.add, "min": jnp.minimum, "max": jnp.maximum, "product": operator.mul,
    "band": jnp.bitwise_and, "bor": jnp.bitwise_or, "bxor": jnp.bitwise_xor,
}


class GroupMesh:
    """The mesh of one process group: rank ``i`` of the group owns ``devices[i]``."""

    def __init__(self, devices, local_index: int):
        self.devices = list(devices)
        self.size = len(self.devices)
        self.index = local_index
        self.device = self.devices[local_index]
        self.mesh = Mesh(np.array(self.devices, dtype=object), (AXIS,))
        self.sharding = NamedSharding(self.mesh, P(AXIS))
        # Sum-scatters as all_to_all + local sum where that is the faster program (module doc).
        self.exchange_scatter = self.device.platform == "cpu"
        self._programs: dict = {}

    # -- moving blocks in and out --------------------------------------------------------------

    def globalize(self, block: jax.Array) -> jax.Array:
        """This rank's flat block as its shard of a global array sharded over the ranks."""
        if block.ndim != 1:
            block = block.reshape(-1)
        if block.devices() != {self.device}:
            block = jax.device_put(block, self.device)
        shape = (block.shape[0] * self.size,)
        return jax.make_array_from_single_device_arrays(shape, self.sharding, [block])

    @staticmethod
    def local(result: jax.Array) -> jax.Array:
        return result.addressable_shards[0].data

    def run(self, kind: str, blocks: list, **static) -> list:
        """Run collective ``kind`` on this rank's flat ``blocks``; this rank's output blocks."""
        program = self._program(kind, len(blocks), tuple(sorted(static.items())))
        outputs = program(*[self.globalize(b) for b in blocks])
        return [self.local(o) for o in outputs]

    def _program(self, kind, count, static):
        key = (kind, count, static, self.exchange_scatter)
        program = self._programs.get(key)
        if program is None:
            extra = {"exchange": self.exchange_scatter} if kind in _SCATTERING else {}
            body = functools.partial(_BODIES[kind], n=self.size, **dict(static), **extra)
            per_block = lambda *xs: tuple(body(x) for x in xs)  # noqa: E731
            specs = tuple(P(AXIS) for _ in range(count))
            program = jax.jit(_shard_map(per_block, mesh=self.mesh, in_specs=specs,
                                         out_specs=specs, check_vma=False))
            self._programs[key] = program
        return program


# ---------------------------------------------------------------------------------------------
# Per-device bodies (x is this rank's flat block inside shard_map)
# ---------------------------------------------------------------------------------------------


def _reduce_rows(rows, op):
    """Reduce ``rows`` (n, m) over the rank axis with element-wise ``op``, in rank order."""
    return functools.reduce(ELEMENTWISE[op], [rows[i] for i in range(rows.shape[0])])


def _all_reduce(x, n, op, average=False):
    if op in NATIVE:
        out = NATIVE[op](x, AXIS)
    else:
        out = _reduce_rows(jax.lax.all_gather(x, AXIS, axis=0, tiled=False), op)
    return out / n if average else out


def _all_gather(x, n):
    return jax.lax.all_gather(x, AXIS, axis=0, tiled=True)


def _exchange_rows(x, n):
    """Row j of the result is rank j's contribution to this rank's chunk of ``x``."""
    return jax.lax.all_to_all(x.reshape(n, -1), AXIS, 0, 0, tiled=True)


def _reduce_scatter(x, n, op, average=False, exchange=False):
    if op == "sum" and not exchange:
        out = jax.lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)
    else:  # summed in rank order, so every rank's chunk is reduced the same way
        out = _reduce_rows(_exchange_rows(x, n), op)
    return out / n if average else out


def _broadcast(x, n, src):
    # Only the source contributes, so the sum is exact (x + 0 == x) and costs one all-reduce
    # instead of the n-fold traffic of gathering every rank's copy.
    mine = jax.lax.axis_index(AXIS) == src
    if x.dtype == jnp.bool_:
        return jax.lax.psum(jnp.where(mine, x, False).astype(jnp.int32), AXIS) > 0
    return jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), AXIS)


def _scatter(x, n, src, exchange=False):
    # The source's block is the concatenation of every rank's chunk; the others contribute
    # zeros of that size, so a reduce-scatter hands each rank its chunk exactly; with an
    # exchange, each rank simply keeps the source's row (no arithmetic at all).
    if exchange:
        return _exchange_rows(x, n)[src]
    mine = jax.lax.axis_index(AXIS) == src
    if x.dtype == jnp.bool_:
        x = jnp.where(mine, x, False).astype(jnp.int32)
        return jax.lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True) > 0
    x = jnp.where(mine, x, jnp.zeros_like(x))
    return jax.lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)


def _all_to_all(x, n):
    return _exchange_rows(x, n).reshape(-1)


def _permute(x, n, pairs):
    return jax.lax.ppermute(x, AXIS, perm=list(pairs))


_SCATTERING = ("reduce_scatter", "scatter")  # kinds whose formulation is per platform

_BODIES = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "scatter": _scatter,
    "all_to_all": _all_to_all,
    "permute": _permute,
}


# ---------------------------------------------------------------------------------------------
# Uneven all-to-all: pad every chunk to the largest one, exchange, trim.
# ---------------------------------------------------------------------------------------------


@jax.jit
def _gather_rows(source, index):
    """``source`` rows picked by ``index``; index -1 picks a zero row (padding)."""
    padded = jnp.concatenate([source, jnp.zeros((1,) + source.shape[1:], source.dtype)])
    return padded[index]


def padded_send_index(splits, width: int) -> np.ndarray:
    """Row index (n, width) laying out chunks of ``splits`` rows, padded to ``width``."""
    index = np.full((len(splits), width), -1, dtype=np.int32)
    offset = 0
    for j, count in enumerate(splits):
        index[j, :count] = np.arange(offset, offset + count)
        offset += count
    return index


def unpadded_receive_index(splits, width: int) -> np.ndarray:
    """Row index picking the ``splits[j]`` valid rows out of each padded chunk ``j``."""
    return np.concatenate([np.arange(j * width, j * width + c, dtype=np.int32)
                           for j, c in enumerate(splits)] or [np.zeros(0, np.int32)])


def all_to_all_uneven(group: GroupMesh, run, rows: jax.Array, send_splits, recv_splits,
                      width: int) -> jax.Array:
    """Exchange ``rows`` (N, ...) in chunks of ``send_splits`` rows; returns the received
    rows (sum(recv_splits), ...). ``width`` is the largest chunk over all ranks and pairs;
    ``run(kind, blocks)`` runs a collective on ``group`` (the caller's guarded runner)."""
    n = group.size
    tail = rows.shape[1:]
    if rows.shape[0] == 0:
        rows = jnp.zeros((0,) + tail, rows.dtype, device=group.device)
    send = _gather_rows(rows, jnp.asarray(padded_send_index(send_splits, width).reshape(-1)))
    (received,) = run("all_to_all", [send.reshape(-1)])
    received = received.reshape((n * width,) + tail)
    return _gather_rows(received, jnp.asarray(unpadded_receive_index(recv_splits, width)))
