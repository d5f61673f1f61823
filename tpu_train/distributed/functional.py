"""``torch.distributed._functional_collectives`` on tpu tensors.

The functional collectives (``_c10d_functional::*``, DTensor's and FSDP's path) are C++ kernels
that allocate and copy tensors with ATen ops the tpu device serves only through Python. On a
tpu tensor they reach ``TpuTensor.__torch_dispatch__``; the handlers here do what those kernels
do: allocate the output on the device, call the group's collective, and register the Work
under the output so that ``wait_tensor`` (torch's own kernel) waits for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_work, _resolve_process_group

F = torch.ops._c10d_functional


def _group(group_name):
    return _resolve_process_group(group_name) if isinstance(group_name, str) else group_name


def _op(name: str):
    return getattr(dist.ReduceOp, name.upper())


def _allreduce_opts(reduce_op):
    opts = dist.AllreduceOptions()
    opts.reduceOp = _op(reduce_op)
    return opts


def _reduce_scatter_opts(reduce_op):
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = _op(reduce_op)
    return opts


def dense(tensor):
    """``tensor`` with contiguous geometry (a copy when it has none).

    The handlers here run inside ``__torch_dispatch__``, below autograd, where composite
    "may alias" ops such as ``contiguous``/``reshape`` arrive undecomposed; the device layer
    decomposes them now, but an explicit ``clone`` does not depend on that (earlier it
    relabelled the storage of a non-contiguous tensor instead of copying).
    """
    if tensor.is_contiguous():
        return tensor
    return torch.ops.aten.clone.default(tensor, memory_format=torch.contiguous_format)


def _register(outputs, work):
    for out in outputs:
        _register_work(out, work)


def all_reduce_(func, args, kwargs):
    tensor, reduce_op, group_name = args
    _register([tensor], _group(group_name).allreduce([tensor], _allreduce_opts(reduce_op)))
    return tensor


def all_reduce(func, args, kwargs):
    tensor, *rest = args
    return all_reduce_(func, (tensor.clone(memory_format=torch.contiguous_format), *rest), kwargs)


def all_reduce_coalesced_(func, args, kwargs):
    tensors, reduce_op, group_name = args
    work = _group(group_name).allreduce_coalesced(list(tensors), _allreduce_opts(reduce_op))
    _register(tensors, work)
    return list(tensors)


def all_reduce_coalesced(func, args, kwargs):
    tensors, *rest = args
    return all_reduce_coalesced_(func, ([t.clone() for t in tensors], *rest), kwargs)


def _gathered(tensor, group_size):
    return tensor.new_empty((tensor.shape[0] * group_size, *tensor.shape[1:]))


def all_gather_into_tensor_coalesced(func, args, kwargs):
    inputs, group_size, group_name = args
    outputs = [_gathered(t, group_size) for t in inputs]
    inputs = [dense(t) for t in inputs]
    _register(outputs, _group(group_name).allgather_into_tensor_coalesced(outputs, inputs))
    return outputs


def all_gather_into_tensor(func, args, kwargs):
    tensor, group_size, group_name = args
    return all_gather_into_tensor_coalesced(func, ([tensor], group_size, group_name), {})[0]


def all_gather_into_tensor_out(func, args, kwargs):
    tensor, group_size, group_name = args
    out = kwargs["out"]
    _register([out], _group(group_name).allgather_into_tensor_coalesced([out], [tensor]))
    return out


def reduce_scatter_tensor_coalesced(func, args, kwargs):
    inputs, reduce_op, group_size, group_name = args
    outputs = [t.new_empty((t.shape[0] // group_size, *t.shape[1:])) for t in inputs]
    work = _group(group_name).reduce_scatter_tensor_coalesced(
        outputs, [dense(t) for t in inputs], _reduce_scatter_opts(reduce_op))
    _register(outputs, work)
    return outputs


def reduce_scatter_tensor(func, args, kwargs):
    tensor, reduce_op, group_size, group_name = args
    return reduce_scatter_tensor_coalesced(
        func, ([tensor], reduce_op, group_size, group_name), {})[0]


def reduce_scatter_tensor_out(func, args, kwargs):
    tensor, reduce_op, group_size, group_name = args
    out = kwargs["out"]
    work = _group(group_name).reduce_scatter_tensor_coalesced(
        [out], [dense(tensor)], _reduce_scatter_opts(reduce_op))
    _register([out], work)
    return out


def all_to_all_single(func, args, kwargs):
    tensor, output_splits, input_splits, group_name = args
    group = _group(group_name)
    rows = sum(output_splits) if output_splits else tensor.shape[0]
    out = tensor.new_empty((rows, *tensor.shape[1:]))
    work = group.alltoall_base(out, dense(tensor), list(output_splits),
                               list(input_splits), dist.AllToAllOptions())
    _register([out], work)
    return out


def broadcast_(func, args, kwargs):
    tensor, src, group_name = args
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    _register([tensor], _group(group_name).broadcast([tensor], opts))
    return tensor


def broadcast(func, args, kwargs):
    tensor, *rest = args
    return broadcast_(func, (tensor.clone(memory_format=torch.contiguous_format), *rest), kwargs)


def shard_dim_alltoall(func, args, kwargs):
    """DTensor's ``Shard(a) -> Shard(b)``: ``input`` is this rank's piece along ``gather_dim``;
    the result is the whole along ``gather_dim`` and this rank's piece along ``shard_dim``.

    Equal chunks along ``shard_dim`` go one to each rank (DTensor pads uneven shards before
    calling); what comes back is concatenated along ``gather_dim``. Synchronous, as torch's
    own kernel is.
    """
    tensor, gather_dim, shard_dim, group_name = args
    group = _group(group_name)
    size = group.size()
    length = tensor.shape[shard_dim] // size
    inputs = [dense(tensor.narrow(shard_dim, i * length, length)) for i in range(size)]
    outputs = [torch.empty_like(piece) for piece in inputs]
    group.alltoall(outputs, inputs, dist.AllToAllOptions()).wait()
    return torch.cat(outputs, dim=gather_dim)


def wrap_tensor_autograd(func, args, kwargs):
    """A funcol result on a tpu tensor: waited and returned as a plain tpu tensor.

    torch wraps every eager functional-collective result in an ``AsyncCollectiveTensor`` that
    waits on first use. The tpu tensor's ``__torch_dispatch__`` runs first when it is the left
    operand (``h + collective_result``) and does not defer to that wrapper, so the wrapper would
    reach the device as a foreign tensor. Waiting here instead costs little: the result array
    is already in the tensor's storage (JAX dispatches asynchronously) and the wait also
    removes the Work from torch's registry, as the wrapper would on first use.
    """
    from tpu_train.device.tensor import wrap

    (tensor,) = args
    torch.ops._c10d_functional.wait_tensor(tensor)
    return wrap(tensor.jax_value(), tensor.dtype, tensor.device.index, tensor.shape)


def _wrapper_handlers() -> dict:
    # The op exists where torch routes the wrapping through a custom op (torch >= 2.13).
    import torch.distributed._functional_collectives  # noqa: F401  (defines the op)

    op = getattr(F, "_wrap_tensor_autograd", None)
    return {op.default: wrap_tensor_autograd} if op is not None else {}


# The ``_dtensor`` ops exist once torch.distributed.tensor (~1 s to import) is imported, which
# only DTensor users do: these handlers are found by name when such an op first arrives.
HANDLERS_BY_NAME = {"_dtensor.shard_dim_alltoall.default": shard_dim_alltoall}

HANDLERS = {
    F.all_reduce.default: all_reduce,
    F.all_reduce_.default: all_reduce_,
    F.all_reduce_coalesced.default: all_reduce_coalesced,
    F.all_reduce_coalesced_.default: all_reduce_coalesced_,
    F.all_gather_into_tensor.default: all_gather_into_tensor,
    F.all_gather_into_tensor_out.default: all_gather_into_tensor_out,
    F.all_gather_into_tensor_coalesced.default: all_gather_into_tensor_coalesced,
    F.reduce_scatter_tensor.default: reduce_scatter_tensor,
    F.reduce_scatter_tensor_out.default: reduce_scatter_tensor_out,
    F.reduce_scatter_tensor_coalesced.default: reduce_scatter_tensor_coalesced,
    F.all_to_all_single.default: all_to_all_single,
    F.broadcast.default: broadcast,
    F.broadcast_.default: broadcast_,
    **_wrapper_handlers(),
}
