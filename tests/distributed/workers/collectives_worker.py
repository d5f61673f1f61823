"""One rank of the collectives check: every collective through the tpu ProcessGroup (on tpu
and on CPU tensors) against torch's gloo ProcessGroup on CPU tensors with the same data.

Prints ``RESULT {json}`` with the failed cases; exits 1 when any failed.
"""

import contextlib
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import tpu_train  # noqa: F401
import tpu_train.distributed  # noqa: F401
from tests.tolerances import rtol_for  # the harness puts the repository root on PYTHONPATH
from tpu_train.device import storage_of

R = dist.ReduceOp
failures, checked = [], []


def check(name, got, want):
    got = got.cpu() if got.device.type != "cpu" else got
    checked.append(name)
    # A float32 collective reduces over the ranks (length world): rtol_for(float32, world);
    # absolutely, relative to the sum of the magnitudes (~world for unit-normal data).
    world = dist.get_world_size() if dist.is_initialized() else 1
    tol = rtol_for(torch.float32, world)
    ok = got.shape == want.shape and got.dtype == want.dtype and (
        torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * world)
        if want.is_floating_point() else torch.equal(got, want))
    if not ok:
        failures.append(f"{name}: got {got.flatten()[:6].tolist()} want {want.flatten()[:6].tolist()}")


def data(rank, shape, dtype, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(1, 7, shape, generator=g).to(dtype)


def both(fn, cpu_tensors):
    """Run fn on (tpu copies, tpu PG), (cpu copies, tpu PG), (cpu copies, gloo)."""
    on_tpu = [t.to("tpu") for t in cpu_tensors]
    on_cpu = [t.clone() for t in cpu_tensors]
    on_gloo = [t.clone() for t in cpu_tensors]
    fn(on_tpu, None)
    fn(on_cpu, None)
    fn(on_gloo, GLOO)
    return on_tpu, on_cpu, on_gloo


def compare(name, runs, indices=None):
    on_tpu, on_cpu, on_gloo = runs
    for i in (indices if indices is not None else range(len(on_gloo))):
        check(f"{name}[tpu][{i}]", on_tpu[i], on_gloo[i])
        check(f"{name}[cpu][{i}]", on_cpu[i], on_gloo[i])


def scatter_formulations(rank, n):
    """Sum-scatters run as all_to_all + local sum on the CPU client and as XLA's native
    reduce-scatter elsewhere (see collectives.py): check that the CPU one is really in use,
    then run the native one here too, so that the formulation a TPU uses stays tested."""
    mesh = dist.distributed_c10d._get_default_group()._mesh
    checked.append("cpu sum-scatter formulation")
    if not mesh.exchange_scatter:
        failures.append("the CPU client does not use the all_to_all sum-scatter")
    saved = mesh.exchange_scatter, mesh._programs
    mesh.exchange_scatter, mesh._programs = False, {}
    try:
        for op in ["SUM", "MAX"]:
            runs = both(lambda ts, g: dist.reduce_scatter_tensor(ts[0], ts[1], op=getattr(R, op),
                                                                 group=g),
                        [torch.zeros(2, 3), data(rank, (2 * n, 3), torch.float32, salt=7)])
            compare(f"native reduce_scatter_tensor {op}", runs, [0])
        runs = both(lambda ts, g: dist.scatter(ts[0], ts[1:] if rank == 0 else None, src=0,
                                               group=g),
                    [torch.zeros(3)] + [data(rank, (3,), torch.float32, 20 + i) for i in range(n)])
        compare("native scatter", runs, [0])
    finally:
        mesh.exchange_scatter, mesh._programs = saved


def all_reduce_cases(rank, n, label):
    """Every all_reduce case; ``label`` prefixes the case names."""
    # all_reduce: every op on floats, integer-only ops on ints
    for dtype, ops in [(torch.float32, ["SUM", "PRODUCT", "MIN", "MAX"]),
                       (torch.int32, ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]),
                       (torch.int64, ["SUM", "MAX", "BXOR"])]:
        for op in ops:
            runs = both(lambda ts, g: dist.all_reduce(ts[0], op=getattr(R, op), group=g),
                        [data(rank, (5, 3), dtype)])
            compare(f"{label}all_reduce {op} {dtype}", runs)
    # AVG (gloo has none: the oracle is gloo's SUM / n)
    x = data(rank, (7,), torch.float32)
    t = x.to("tpu")
    dist.all_reduce(t, op=R.AVG)
    want = x.clone()
    dist.all_reduce(want, group=GLOO)
    check(f"{label}all_reduce AVG", t, want / n)
    # through a strided view: the base must see the result (DDP bucket views rely on it)
    base = data(rank, (4, 6), torch.float32)
    tb, gb = base.to("tpu"), base.clone()
    dist.all_reduce(tb[:, 1::2])
    part = gb[:, 1::2].contiguous()  # gloo needs contiguous tensors: reduce a copy
    dist.all_reduce(part, group=GLOO)
    gb[:, 1::2] = part
    check(f"{label}all_reduce strided view", tb, gb)
    x = data(rank, (9,), torch.bfloat16)
    runs = both(lambda ts, g: dist.all_reduce(ts[0], group=g), [x])
    # bf16 sums round after every hop, in an order each transport picks: with 4 ranks up to
    # 3 roundings (2^-8 relative each) apart, so allow 2^-5 of the magnitude
    for i, name in ((0, "tpu"), (1, "cpu")):
        checked.append(f"{label}all_reduce bf16[{name}]")
        got, want = runs[i][0].cpu().float(), runs[2][0].float()
        if ((got - want).abs() > 2**-5 * want.abs().clamp_min(1)).any():
            failures.append(f"{label}all_reduce bf16[{name}]: {runs[i][0].cpu()} vs {runs[2][0]}")


def all_reduce_transports(rank, n):
    """All-reduces go through torch's gloo on the CPU client (host_transport.py): check that it
    is really in use, then run every case through XLA's program too (what TPUs and GPUs run)."""
    group = dist.distributed_c10d._get_default_group()
    checked.append("cpu all_reduce transport")
    if group._host is None:
        failures.append("the CPU client does not all-reduce over gloo")
    # A buffer XLA computed is reduced in its own memory; a tensor sharing its array with
    # another keeps the other's value intact (the reduction copies).
    x = data(rank, (6, 2), torch.float32)
    want = x.clone()
    dist.all_reduce(want, group=GLOO)
    t = x.to("tpu") * 1
    before = group._host.in_place
    dist.all_reduce(t)
    check("all_reduce in place: value", t, want)
    checked.append("all_reduce in place: no copy")
    if group._host.in_place != before + 1:
        failures.append("an exclusively held XLA buffer was copied instead of reduced in place")
    # A second holder of the tensor's array (here the test itself; in the library, anything
    # that kept a reference to the immutable array) must keep seeing the old values.
    shared = x.flatten().to("tpu") * 1
    held = storage_of(shared).buffer
    before = group._host.in_place
    dist.all_reduce(shared)
    check("all_reduce of a tensor whose array is also held: result", shared, want.flatten())
    checked.append("all_reduce of a tensor whose array is also held: copied")
    if group._host.in_place != before:
        failures.append("an array held elsewhere was reduced in place")
    check("all_reduce of a tensor whose array is also held: the other holder",
          torch.from_numpy(np.asarray(held).copy()), x.flatten())
    saved, group._host = group._host, None
    try:
        all_reduce_cases(rank, n, "xla ")
    finally:
        group._host = saved


def main():
    global GLOO
    dist.init_process_group("tpu")
    rank, n = dist.get_rank(), dist.get_world_size()
    GLOO = dist.new_group(backend="gloo")
    last = n - 1

    all_reduce_cases(rank, n, "")
    all_reduce_transports(rank, n)

    # all_gather (list) and all_gather_into_tensor
    x = data(rank, (3, 2), torch.float32)
    runs = both(lambda ts, g: dist.all_gather(ts[1:], ts[0], group=g),
                [x] + [torch.zeros(3, 2) for _ in range(n)])
    compare("all_gather", runs)
    runs = both(lambda ts, g: dist.all_gather_into_tensor(ts[1], ts[0], group=g),
                [x, torch.zeros(3 * n, 2)])
    compare("all_gather_into_tensor", runs, [1])

    # reduce_scatter (list) and reduce_scatter_tensor
    for op in ["SUM", "MAX", "MIN", "PRODUCT"]:
        inputs = [data(rank, (4,), torch.float32, salt=i) for i in range(n)]
        runs = both(lambda ts, g: dist.reduce_scatter(ts[0], ts[1:], op=getattr(R, op), group=g),
                    [torch.zeros(4)] + inputs)
        compare(f"reduce_scatter {op}", runs, [0])
        runs = both(lambda ts, g: dist.reduce_scatter_tensor(ts[0], ts[1], op=getattr(R, op),
                                                             group=g),
                    [torch.zeros(2, 3), data(rank, (2 * n, 3), torch.float32)])
        compare(f"reduce_scatter_tensor {op}", runs, [0])

    # coalesced variants, through torch's coalescing manager
    def coalesced(kind):
        def fn(ts, g):
            # gloo (the oracle) runs them one by one; the tpu group gets torch's fast path,
            # which hands the whole list to its *_coalesced method in one call.
            manager = dist._coalescing_manager(group=dist.group.WORLD) if g is None else \
                contextlib.nullcontext()
            with manager:
                if kind == "all_reduce":
                    for t in ts:
                        dist.all_reduce(t, group=g)
                elif kind == "all_gather":
                    for out, inp in zip(ts[::2], ts[1::2]):
                        dist.all_gather_into_tensor(out, inp, group=g)
                else:
                    for out, inp in zip(ts[::2], ts[1::2]):
                        dist.reduce_scatter_tensor(out, inp, group=g)
        return fn

    runs = both(coalesced("all_reduce"), [data(rank, (3,), torch.float32, salt=s) for s in range(3)])
    compare("allreduce_coalesced", runs)
    runs = both(coalesced("all_gather"), [torch.zeros(2 * n), data(rank, (2,), torch.float32),
                                          torch.zeros(3 * n), data(rank, (3,), torch.float32, 1)])
    compare("allgather_into_tensor_coalesced", runs, [0, 2])
    runs = both(coalesced("reduce_scatter"), [torch.zeros(2), data(rank, (2 * n,), torch.float32),
                                              torch.zeros(3), data(rank, (3 * n,), torch.float32, 1)])
    compare("reduce_scatter_tensor_coalesced", runs, [0, 2])

    # rooted collectives
    runs = both(lambda ts, g: dist.broadcast(ts[0], src=last, group=g), [data(rank, (6,), torch.float32)])
    compare("broadcast", runs)
    runs = both(lambda ts, g: dist.broadcast(ts[0], src=0, group=g), [data(rank, (4,), torch.int64)])
    compare("broadcast int64", runs)
    x = data(rank, (5,), torch.float32)
    runs = both(lambda ts, g: dist.reduce(ts[0], dst=1, group=g), [x])
    if rank == 1:
        compare("reduce", runs)
    else:  # non-destination ranks must keep their input
        check("reduce keeps input[tpu]", runs[0][0], x)
    runs = both(lambda ts, g: dist.gather(ts[0], ts[1:] if rank == 0 else None, dst=0, group=g),
                [data(rank, (3,), torch.float32)] + [torch.zeros(3) for _ in range(n)])
    if rank == 0:
        compare("gather", runs)
    runs = both(lambda ts, g: dist.scatter(ts[0], ts[1:] if rank == 1 else None, src=1, group=g),
                [torch.zeros(2, 2)] + [data(rank, (2, 2), torch.float32, i) for i in range(n)])
    compare("scatter", runs, [0])
    scatter_formulations(rank, n)

    # all_to_all_single: even, uneven splits; all_to_all of lists with unequal sizes
    runs = both(lambda ts, g: dist.all_to_all_single(ts[0], ts[1], group=g),
                [torch.zeros(2 * n, 3), data(rank, (2 * n, 3), torch.float32)])
    compare("all_to_all_single even", runs, [0])
    send = [(rank + k) % 3 + 1 for k in range(n)]  # rows rank sends to rank k
    recv = [(j + rank) % 3 + 1 for j in range(n)]  # rows rank j sends to this rank
    runs = both(lambda ts, g: dist.all_to_all_single(ts[0], ts[1], recv, send, group=g),
                [torch.zeros(sum(recv), 2), data(rank, (sum(send), 2), torch.float32)])
    compare("all_to_all_single uneven", runs, [0])
    ins = [data(rank, (send[k],), torch.float32, k) for k in range(n)]
    outs = [torch.zeros(recv[j]) for j in range(n)]
    # gloo's list all_to_all wants equal sizes: its uneven all_to_all_single is the oracle
    flat = torch.zeros(sum(recv))
    dist.all_to_all_single(flat, torch.cat(ins), recv, send, group=GLOO)
    for device in ("tpu", "cpu"):
        got = [o.clone().to(device) for o in outs]
        dist.all_to_all(got, [i.to(device) for i in ins])
        check(f"all_to_all list[{device}]", torch.cat([g.cpu() for g in got]), flat)

    # send / recv between pairs (0->1, 2->3, ...)
    x = data(rank, (4, 2), torch.float32)
    for device in ("tpu", "cpu"):
        if rank % 2 == 0 and rank + 1 < n:
            dist.send(x.to(device), dst=rank + 1)
        elif rank % 2 == 1:
            got = torch.zeros(4, 2, device=device)
            dist.recv(got, src=rank - 1)
            check(f"recv[{device}]", got, data(rank - 1, (4, 2), torch.float32))

    # barrier really waits for the slowest rank
    dist.barrier()
    if rank == 0:
        time.sleep(1.5)
    start = time.monotonic()
    dist.barrier()
    waited = time.monotonic() - start
    if rank != 0 and waited < 1.0:
        failures.append(f"barrier returned after {waited:.2f} s although rank 0 slept 1.5 s")
    checked.append("barrier")

    # async_op Work
    x = data(rank, (8,), torch.float32)
    t = x.to("tpu")
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    want = x.clone()
    dist.all_reduce(want, group=GLOO)
    check("all_reduce async_op", t, want)
    if not work.is_completed():
        failures.append("async Work not completed after wait()")

    # subgroups: ranks {0, last} reduce while the others (if any) reduce among themselves
    first_ranks, rest = [0, last], [r for r in range(n) if r not in (0, last)]
    sub, sub_gloo = dist.new_group(first_ranks), dist.new_group(first_ranks, backend="gloo")
    other = dist.new_group(rest) if rest else None
    other_gloo = dist.new_group(rest, backend="gloo") if rest else None
    x = data(rank, (5,), torch.float32)
    t, want = x.to("tpu"), x.clone()
    if rank in first_ranks:
        dist.all_reduce(t, group=sub)
        dist.all_reduce(want, group=sub_gloo)
    elif rest:
        dist.all_reduce(t, group=other)
        dist.all_reduce(want, group=other_gloo)
    check("subgroup all_reduce", t, want)
    if rank in first_ranks:  # group-local ranks: src=1 is the group's second member
        b = data(rank, (3,), torch.float32).to("tpu")
        dist.broadcast(b, group_src=1, group=sub)
        check("subgroup broadcast", b, data(last, (3,), torch.float32))

    # functional collectives (DTensor's path) on tpu tensors vs gloo
    x = data(rank, (4, 2), torch.float32)
    got = funcol.wait_tensor(funcol.all_reduce(x.to("tpu"), "sum", dist.group.WORLD))
    check("funcol all_reduce", got, funcol.wait_tensor(funcol.all_reduce(x, "sum", GLOO)))
    got = funcol.wait_tensor(funcol.all_gather_tensor(x.to("tpu"), 0, dist.group.WORLD))
    check("funcol all_gather_tensor", got, funcol.wait_tensor(funcol.all_gather_tensor(x, 0, GLOO)))
    y = data(rank, (2 * n, 3), torch.float32)
    got = funcol.wait_tensor(funcol.reduce_scatter_tensor(y.to("tpu"), "sum", 0, dist.group.WORLD))
    check("funcol reduce_scatter_tensor", got,
          funcol.wait_tensor(funcol.reduce_scatter_tensor(y, "sum", 0, GLOO)))

    # DeviceMesh sub-meshes (2-D when the world allows)
    if n == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh.get_group("tp")
        tp_ranks = dist.get_process_group_ranks(tp)
        x = data(rank, (3,), torch.float32)
        t = x.to("tpu")
        dist.all_reduce(t, group=tp)
        check("device_mesh tp all_reduce", t, sum(data(r, (3,), torch.float32) for r in tp_ranks))

    print("RESULT " + json.dumps({"rank": rank, "checked": len(checked), "failures": failures}),
          flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
