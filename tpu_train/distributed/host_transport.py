"""All-reduce over torch's gloo ProcessGroup where the devices are host CPUs.

On TPU and GPU an all-reduce is an XLA collective on the interconnect (ICI, NCCL). On the CPU
client XLA carries its collectives over its own gloo transport, which moves data at about half
the rate of torch's gloo and page-faults a fresh output buffer per call (64 MB, 2 processes:
XLA ``psum`` 107 ms vs torch gloo 46 ms, docs/distributed.md). There the group's all-reduces go
through a private torch gloo ProcessGroup instead (``TPU_TRAIN_CPU_ALLREDUCE=gloo``, the
default; ``xla`` keeps XLA's program, the one TPUs run).

Gloo reduces in place, and device arrays are immutable. So the buffer gloo writes into is made
exclusively ours first, without copying where that is safe: when the tensor spans its whole
storage and the storage is the only holder of its array, the array is *donated* to an identity
program, whose output is the same memory (XLA waits for pending readers; a buffer with external
views, e.g. numpy's, is copied instead of donated). Otherwise the block is copied into a fresh
array. Gloo then reduces in that memory through a DLPack view, and the array becomes the
tensor's value. Until the Work completes the tensor must not be read: as with gloo on CPU tensors.
CPU tensors given to the ``tpu`` group are reduced by gloo in place.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import torch
import torch.distributed as dist

TRANSPORT_ENV = "TPU_TRAIN_CPU_ALLREDUCE"
TRANSPORTS = ("gloo", "xla")

_R = dist.ReduceOp
_GLOO_OPS = {"sum": _R.SUM, "product": _R.PRODUCT, "min": _R.MIN, "max": _R.MAX,
             "band": _R.BAND, "bor": _R.BOR, "bxor": _R.BXOR}
# Element types gloo reduces (bool and the rest run XLA's program). A tpu tensor's storage
# type is one of these too (64-bit types may be stored as 32-bit ones).
_GLOO_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                torch.uint8, torch.int32, torch.int64}

# Identity with its input donated: the output is the input's memory, owned by nobody else.
_take_over = jax.jit(lambda x: x, donate_argnums=0)


def transport() -> str:
    """The CPU all-reduce transport chosen by ``TPU_TRAIN_CPU_ALLREDUCE`` (default gloo)."""
    chosen = os.environ.get(TRANSPORT_ENV, "gloo").strip().lower()
    if chosen not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV}={os.environ[TRANSPORT_ENV]!r} is not a transport: "
                         f"use one of {', '.join(TRANSPORTS)}")
    return chosen


class GlooAllReduce:
    """A group's all-reduces over a private torch gloo ProcessGroup (see the module doc)."""

    def __init__(self, store, rank: int, size: int, timeout, group_id: str, device,
                 device_index: int):
        prefixed = dist.PrefixStore(f"tpu_train/host_allreduce/{group_id}", store)
        self._gloo = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        self._size = size
        self._device = device
        self._device_index = device_index
        self.in_place = 0  # reductions done in the tensor's own memory, without a copy

    def supports(self, tensors, op: str) -> bool:
        from tpu_train.device.tensor import TpuTensor, storage_of

        if op not in _GLOO_OPS and op != "avg":
            return False
        # A tpu tensor must live on this rank's device alone (not a sharded SPMD array).
        return all(t.dtype in _GLOO_DTYPES and (not isinstance(t, TpuTensor)
                                                or storage_of(t).buffer.devices() == {self._device})
                   for t in tensors)

    def launch(self, tensors, op: str):
        """Start reducing ``tensors`` (tpu or CPU) with ``op`` (a key of ``_GLOO_OPS`` or
        ``"avg"``); returns ``complete()``, which waits for gloo and makes the results the
        tensors' values (through their views)."""
        from tpu_train.device.tensor import TpuTensor

        average = op == "avg"

        if average and any(not t.dtype.is_floating_point for t in tensors):
            raise TypeError("ReduceOp.AVG needs floating-point tensors on the tpu backend")
        options = dist.AllreduceOptions()
        options.reduceOp = _GLOO_OPS["sum" if average else op]
        pending = []
        for tensor in tensors:
            if isinstance(tensor, TpuTensor):
                target, finish = self._exclusive(tensor)
            elif tensor.is_contiguous():
                target, finish = tensor.detach(), None
            else:  # gloo needs contiguous memory: reduce a copy, then write it back
                target = tensor.detach().contiguous()
                finish = lambda t=tensor, c=target: t.detach().copy_(c)  # noqa: E731
            pending.append((self._gloo.allreduce([target], options), target, finish))

        def complete():
            for work, target, finish in pending:
                work.wait()
                if average:
                    target.div_(self._size)
                if finish is not None:
                    finish()
            pending.clear()  # drop the DLPack views: the arrays are plain device arrays again

        return complete

    def _exclusive(self, tensor):
        """Memory only this reduction may write, holding ``tensor``'s elements, as a torch
        view; and the function that makes it the tensor's value once reduced."""
        from tpu_train.device.mutation import assign
        from tpu_train.device.tensor import owns_whole_storage, storage_of, wrap

        storage = storage_of(tensor)
        whole = owns_whole_storage(tensor)
        # 2 references: the storage's and getrefcount's argument. More: another storage or
        # a caller shares this array, and donating it would delete their value.
        if whole and sys.getrefcount(storage.buffer) == 2:
            address = storage.buffer.unsafe_buffer_pointer()
            array = _take_over(storage.buffer)
            storage.buffer = array  # the donated input is deleted: install its successor now
            self.in_place += array.unsafe_buffer_pointer() == address
            finish = None
        else:
            array = jnp.array(tensor.jax_value().reshape(-1), copy=True)
            shape, dtype, index = tuple(tensor.shape), tensor.dtype, self._device_index
            finish = lambda: assign(tensor, wrap(array, dtype, index, shape=shape))  # noqa: E731
        array.block_until_ready()  # XLA may still be filling it
        return torch.from_dlpack(array), finish
