"""The ``tpu`` ProcessGroup: torch.distributed collectives as JAX collectives.

``dist.init_process_group("tpu")`` (or ``"cpu:gloo,tpu:tpu"``-style configs) creates one
:class:`TpuProcessGroup` per group. It serves ``tpu`` tensors and CPU tensors (these are copied
to this rank's device, reduced there and copied back). Every method takes the group-local ranks
torch passes, runs one jitted program over the group's mesh (see :mod:`.collectives`), writes
the results into the given tensors through their views (so DDP's bucket views and FSDP's
all-gather outputs see them) and returns a Work fulfilled when the result arrays are ready.
Where the devices are host CPUs, all-reduces run over torch's gloo instead (see
:mod:`.host_transport`); on TPU and GPU every collective is XLA's.
"""

from __future__ import annotations

import datetime

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist

from tpu_train.distributed import host_transport
from tpu_train.distributed import init as init_mod
from tpu_train.distributed.collectives import GroupMesh, all_to_all_uneven
from tpu_train.distributed.health import Completer, Health

BACKEND = "tpu"
_RED = dist.ReduceOp.RedOpType
_OPS = {_RED.SUM: "sum", _RED.AVG: "avg", _RED.PRODUCT: "product", _RED.MIN: "min",
        _RED.MAX: "max", _RED.BAND: "band", _RED.BOR: "bor", _RED.BXOR: "bxor"}
# bool tensors reduce as int32 0/1: SUM/MAX/BOR are "any", PRODUCT/MIN/BAND are "all".
_BOOL_OPS = {"sum": "max", "max": "max", "bor": "max", "product": "min", "min": "min",
             "band": "min", "bxor": "bxor"}

_process: dict = {}  # per-process singletons: the Health publisher and the Completer


class TpuWork(dist.Work):
    """A Work over a torch Future that the collective's completion fulfils or fails.

    (torch's own future-wrapping Work swallows a failed Future in ``wait()``; a lost peer
    must raise.)"""

    def __init__(self, future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None):
        self._future.wait()  # raises the collective's error
        return True

    def is_completed(self):
        return self._future.done()

    def is_success(self):
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def exception(self):
        try:
            self._future.value()
        except Exception as error:
            return error
        return None

    def get_future(self):
        return self._future

    def synchronize(self):
        self.wait()


def _op_name(reduce_op) -> str:
    kind = getattr(reduce_op, "op", reduce_op)
    try:
        return _OPS[kind]
    except KeyError:
        raise ValueError(f"the tpu backend does not support ReduceOp {reduce_op}") from None


class TpuProcessGroup(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives are JAX programs over the group's devices."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta,
                 group_id: str, global_ranks):
        super().__init__(rank, size)
        from tpu_train.device import module, runtime

        self._group_id = group_id
        self._global_ranks = list(global_ranks) or list(range(size))
        self._timeout_s = init_mod.collective_timeout(timeout)
        self._device_index = module.current_device()
        device = runtime.jax_device(self._device_index)
        # Which JAX device each group rank owns: published through the store, because the
        # torch rank and JAX's process index need not agree (auto-detected TPU pods).
        store.set(f"jax_device/{rank}", str(device.id))
        by_id = {d.id: d for d in jax.devices()}
        ids = [int(store.get(f"jax_device/{r}")) for r in range(size)]
        self._mesh = GroupMesh([by_id[i] for i in ids], rank)
        self._pairs: dict = {}
        if "health" not in _process:
            _process["health"] = Health(store, self._global_ranks[rank], self._global_ranks)
            _process["completer"] = Completer()
        # All-reduces over torch's gloo where the devices are host CPUs (host_transport doc).
        self._host = None
        if device.platform == "cpu" and host_transport.transport() == "gloo":
            self._host = host_transport.GlooAllReduce(
                store, rank, size, datetime.timedelta(seconds=self._timeout_s), group_id,
                device, self._device_index)
        self._health = _process["health"]
        self._completer = _process["completer"]

    # -- identity --------------------------------------------------------------------------------

    @property
    def group_name(self):  # functional collectives look the group up by this name
        return self._group_id

    def getBackendName(self):
        return BACKEND

    @property
    def name(self):
        return BACKEND

    # -- plumbing --------------------------------------------------------------------------------

    def _array(self, tensor: torch.Tensor) -> jax.Array:
        from tpu_train.device.tensor import TpuTensor, put_cpu_tensor

        if isinstance(tensor, TpuTensor):
            return tensor.jax_value().reshape(-1)
        return put_cpu_tensor(tensor, self._mesh.device)

    def _launch(self, what: str, writes, group=None, ranks=None):
        """Write ``(tensor, array)`` results and return a Work done when they are ready."""
        from tpu_train.device.mutation import assign
        from tpu_train.device.tensor import TpuTensor, to_host, wrap

        group = group or self._group_id
        ranks = ranks or self._global_ranks
        host_writes = []
        for tensor, array in writes:
            if isinstance(tensor, TpuTensor):
                assign(tensor, wrap(array.reshape(tuple(tensor.shape)), tensor.dtype,
                                    self._device_index))
            else:
                host_writes.append((tensor, array))

        def finish():
            for tensor, array in host_writes:
                value = to_host(wrap(array, tensor.dtype, self._device_index))
                with torch.no_grad():
                    tensor.copy_(value.reshape(tensor.shape))

        return self._work(what, [a for _, a in writes], [t for t, _ in writes], finish,
                          group, ranks)

    def _run(self, kind, blocks, mesh=None, group=None, ranks=None, what=None, **static):
        """``mesh.run`` under the dispatch deadline (see health.Completer.dispatching)."""
        health, group = self._health, group or self._group_id
        ranks = ranks or self._global_ranks
        with self._completer.dispatching(self._timeout_s,
                                         lambda: health.diagnose(group, ranks, what or kind)):
            return (mesh or self._mesh).run(kind, blocks, **static)

    def _count(self, group=None):
        group = group or self._group_id
        launched = self._health.launched
        launched[group] = launched.get(group, 0) + 1
        return launched[group]

    def _reduce(self, blocks, reduce_op, kind="all_reduce"):
        """Run a reduction on flat blocks; AVG and bool handled here. Returns output blocks."""
        op = _op_name(reduce_op)
        average = op == "avg"
        if average:
            op = "sum"
            if any(not jnp.issubdtype(b.dtype, jnp.inexact) for b in blocks):
                raise TypeError("ReduceOp.AVG needs floating-point tensors on the tpu backend")
        outputs = []
        for block in blocks:  # bool and bitwise ops need per-dtype handling; group by dtype
            is_bool = block.dtype == jnp.bool_
            if op in ("band", "bor", "bxor") and jnp.issubdtype(block.dtype, jnp.inexact):
                raise TypeError(f"ReduceOp.{op.upper()} needs integer or bool tensors")
            this_op = _BOOL_OPS[op] if is_bool else op
            outputs.append((block.astype(jnp.int32) if is_bool else block, this_op, is_bool))
        results = [None] * len(outputs)
        for this_op in {o for _, o, _ in outputs}:
            chosen = [i for i, (_, o, _) in enumerate(outputs) if o == this_op]
            ran = self._run(kind, [outputs[i][0] for i in chosen], op=this_op,
                                 average=average)
            for i, value in zip(chosen, ran):
                results[i] = value > 0 if outputs[i][2] else value
        return results

    # -- all-reduce ------------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        return self.allreduce_coalesced(tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        self._count()
        op = _op_name(reduce_op)
        if self._host is not None and self._host.supports(tensors, op):
            complete = self._host.launch(tensors, op)
            return self._work("all_reduce", [], list(tensors), finish=complete)
        outputs = self._reduce([self._array(t) for t in tensors], reduce_op)
        return self._launch("all_reduce", list(zip(tensors, outputs)))

    # -- all-gather ------------------------------------------------------------------------------

    def allgather(self, output_lists, inputs, opts=None):
        self._count()
        gathered = self._run("all_gather", [self._array(t) for t in inputs])
        writes = []
        for outputs, array in zip(output_lists, gathered):
            chunk = array.shape[0] // self.size()
            writes += [(out, array[i * chunk:(i + 1) * chunk]) for i, out in enumerate(outputs)]
        return self._launch("all_gather", writes)

    def _allgather_base(self, output, input, opts=None):
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        self._count()
        gathered = self._run("all_gather", [self._array(t) for t in inputs])
        return self._launch("all_gather_into_tensor", list(zip(outputs, gathered)))

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    # -- reduce-scatter --------------------------------------------------------------------------

    def reduce_scatter(self, outputs, input_lists, opts=None):
        self._count()
        blocks = [jnp.concatenate([self._array(t) for t in inputs]) for inputs in input_lists]
        results = self._reduce(blocks, opts.reduceOp, kind="reduce_scatter")
        return self._launch("reduce_scatter", list(zip(outputs, results)))

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        self._count()
        results = self._reduce([self._array(t) for t in inputs], opts.reduceOp,
                               kind="reduce_scatter")
        return self._launch("reduce_scatter_tensor", list(zip(outputs, results)))

    # -- rooted collectives ----------------------------------------------------------------------

    def broadcast(self, tensors, opts):
        self._count()
        results = self._run("broadcast", [self._array(t) for t in tensors],
                                 src=opts.rootRank)
        return self._launch("broadcast", list(zip(tensors, results)))

    def reduce(self, tensors, opts):
        self._count()
        results = self._reduce([self._array(t) for t in tensors], opts.reduceOp)
        if self.rank() != opts.rootRank:
            return self._done(results, "reduce")
        return self._launch("reduce", list(zip(tensors, results)))

    def gather(self, output_lists, inputs, opts):
        self._count()
        gathered = self._run("all_gather", [self._array(t) for t in inputs])
        if self.rank() != opts.rootRank:
            return self._done(gathered, "gather")
        writes = []
        for outputs, array in zip(output_lists, gathered):
            chunk = array.shape[0] // self.size()
            writes += [(out, array[i * chunk:(i + 1) * chunk]) for i, out in enumerate(outputs)]
        return self._launch("gather", writes)

    def scatter(self, outputs, input_lists, opts):
        self._count()
        blocks = []
        for i, out in enumerate(outputs):  # non-roots get no input lists from torch
            if self.rank() == opts.rootRank:
                inputs = input_lists[i]
                blocks.append(jnp.concatenate([self._array(t) for t in inputs]))
            else:  # non-roots send zeros of the same size (see collectives._scatter)
                blocks.append(jnp.zeros(out.numel() * self.size(), self._array(out).dtype,
                                        device=self._mesh.device))
        results = self._run("scatter", blocks, src=opts.rootRank)
        return self._launch("scatter", list(zip(outputs, results)))

    def _future(self):
        future = torch.futures.Future()
        if getattr(self, "_coalescing", None) is not None:
            self._coalescing.append(future)
        return future

    def _work(self, what, arrays, result, finish=None, group=None, ranks=None):
        """A Work whose Future gets ``result`` once ``arrays`` are ready and ``finish()`` (a
        transport's wait-and-write) has run; failed, naming the lost ranks, at the timeout."""
        future = self._future()
        health = self._health
        group, ranks = group or self._group_id, ranks or self._global_ranks
        self._completer.submit(future, list(arrays), result, self._timeout_s,
                               on_timeout=lambda: health.diagnose(group, ranks, what),
                               finish=finish)
        return TpuWork(future)

    def _done(self, arrays, what):
        """A Work for a rank that takes part in a collective but receives nothing."""
        return self._work(what, arrays, [])

    # -- all-to-all ------------------------------------------------------------------------------

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        self._count()
        n = self.size()
        rows_in = input.shape[0] if input.dim() else 0
        row = int(np.prod(input.shape[1:])) if input.dim() > 1 else 1
        send = list(input_split_sizes) or [rows_in // n] * n
        flat = self._array(input).reshape((rows_in, row))
        if not input_split_sizes and not output_split_sizes:
            (received,) = self._run("all_to_all", [flat.reshape(-1)])
            return self._launch("all_to_all_single", [(output, received)])
        # Uneven: learn every rank's splits (one small all-gather) to pad to a common width.
        splits = self._run("all_gather", [jnp.asarray(send, jnp.int32)])[0]
        matrix = np.asarray(splits).reshape(n, n)  # matrix[j][k]: rows rank j sends rank k
        recv = list(output_split_sizes) or [int(matrix[j][self.rank()]) for j in range(n)]
        width = max(int(matrix.max()), 1)
        received = all_to_all_uneven(self._mesh, self._run, flat, send, recv, width)
        return self._launch("all_to_all_single", [(output, received.reshape(-1))])

    def alltoall(self, outputs, inputs, opts=None):
        self._count()
        flat = jnp.concatenate([self._array(t) for t in inputs]).reshape(-1, 1)
        send = [t.numel() for t in inputs]
        recv = [t.numel() for t in outputs]
        splits = self._run("all_gather", [jnp.asarray(send, jnp.int32)])[0]
        width = max(int(np.asarray(splits).max()), 1)
        received = all_to_all_uneven(self._mesh, self._run, flat, send, recv, width).reshape(-1)
        offsets = np.cumsum([0] + recv)
        writes = [(t, received[offsets[i]:offsets[i + 1]]) for i, t in enumerate(outputs)]
        return self._launch("all_to_all", writes)

    # -- point to point --------------------------------------------------------------------------

    def _pair(self, peer: int):
        """A 2-device mesh (lower group rank first) for send/recv with ``peer``."""
        mesh = self._pairs.get(peer)
        if mesh is None:
            low, high = sorted((self.rank(), peer))
            devices = [self._mesh.devices[low], self._mesh.devices[high]]
            mesh = GroupMesh(devices, 0 if self.rank() == low else 1)
            self._pairs[peer] = mesh
        return mesh

    def _p2p(self, tensor, src, dst, what):
        peer = dst if src == self.rank() else src
        mesh = self._pair(peer)
        pair_name = f"{self._group_id}:p2p:{min(src, dst)}-{max(src, dst)}"
        self._count(pair_name)
        me = mesh.index
        block = self._array(tensor) if src == self.rank() else \
            jnp.zeros(tensor.numel(), self._array(tensor).dtype, device=mesh.device)
        source_index = me if src == self.rank() else 1 - me
        ranks = [self._global_ranks[src], self._global_ranks[dst]]
        (result,) = self._run("permute", [block], mesh=mesh, group=pair_name, ranks=ranks,
                              what=what, pairs=((source_index, 1 - source_index),))
        if dst == self.rank():
            return self._launch(what, [(tensor, result)], group=pair_name, ranks=ranks)
        return self._work(what, [result], [], group=pair_name, ranks=ranks)

    def send(self, tensors, dst, tag=0):
        works = [self._p2p(t, self.rank(), dst, "send") for t in tensors]
        return works[-1]

    def recv(self, tensors, src, tag=0):
        works = [self._p2p(t, src, self.rank(), "recv") for t in tensors]
        return works[-1]

    # -- entry points torch binds in C++ (they would dispatch c10d ops to a C++ backend) ---------

    def all_gather_single(self, output, input, opts=None):
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def _start_coalescing(self, device):
        # Collectives run as they are issued; the coalescing Work waits for all of them.
        self._coalescing = []

    def _end_coalescing(self, device):
        futures, self._coalescing = self._coalescing or [], None
        return TpuWork(torch.futures.collect_all(futures))

    # -- barrier ---------------------------------------------------------------------------------

    def barrier(self, opts=None):
        self._count()
        token = jnp.ones((1,), jnp.int32, device=self._mesh.device)
        (result,) = self._run("all_reduce", [token], op="sum", average=False)
        return self._done([result], "barrier")


def _create(dist_backend_opts, backend_options=None):
    """The creator torch calls for every ``tpu`` group (the world group first)."""
    timeout = dist_backend_opts.timeout
    global_ranks = list(dist_backend_opts.global_ranks_in_group)
    if not init_mod.is_initialized():
        # The world group: start jax.distributed before anything asks JAX for devices.
        init_mod.initialize(rank=dist_backend_opts.group_rank,
                            world_size=dist_backend_opts.group_size,
                            timeout_s=init_mod.collective_timeout(timeout),
                            store=dist_backend_opts.store)
    return TpuProcessGroup(dist_backend_opts.store, dist_backend_opts.group_rank,
                           dist_backend_opts.group_size, timeout,
                           dist_backend_opts.group_id, global_ranks)


_registered = False


def register() -> None:
    """Register the ``tpu`` backend with torch.distributed (idempotent)."""
    global _registered
    if _registered or BACKEND.upper() in dist.Backend._plugins:
        _registered = True
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["tpu", "cpu"])
    _registered = True
