"""The tpu ProcessGroup under torch's own launchers.

``launch_worker.py torchrun PIDDIR``: one rank started by ``torchrun`` (settings from its env).
``launch_worker.py spawn PIDDIR WORLD``: starts WORLD ranks with ``torch.multiprocessing.spawn``
(``MASTER_ADDR``/``MASTER_PORT`` come from the environment; rank and world size are passed to
``init_process_group`` as a spawn script does).

Every rank writes its pid to PIDDIR (so that the caller can make sure none is left behind),
checks an all_reduce and one DDP step against gloo on CPU tensors and writes its result to
``PIDDIR/result-RANK.json`` (ranks share the launcher's stdout, where lines can interleave).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import tpu_train  # noqa: F401
import tpu_train.distributed  # noqa: F401


def ddp_grads(device, group, rank):
    torch.manual_seed(0)
    net = DDP(torch.nn.Linear(6, 3).to(device), process_group=group)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    torch.nn.functional.mse_loss(net(x.to(device)), y.to(device)).backward()
    return [p.grad.cpu() for p in net.parameters()]


def check(rank, world, piddir, launcher):
    with open(os.path.join(piddir, f"pid-{os.getpid()}"), "w") as f:
        f.write(str(os.getpid()))
    if launcher == "spawn":
        dist.init_process_group("tpu", rank=rank, world_size=world)
    else:
        dist.init_process_group("tpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    x = torch.full((5,), float(rank + 1), device="tpu")
    dist.all_reduce(x)
    reduced = x.cpu().tolist()
    tpu, cpu = ddp_grads("tpu", None, rank), ddp_grads("cpu", gloo, rank)
    grad_rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(tpu, cpu))
    result = {"launcher": launcher, "rank": rank, "world": world,
              "all_reduce_ok": reduced == [world * (world + 1) / 2] * 5,
              "backend": dist.get_backend(), "grad_rel": grad_rel}
    with open(os.path.join(piddir, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _spawned(index, world, piddir):
    check(index, world, piddir, "spawn")


def main():
    launcher, piddir = sys.argv[1], sys.argv[2]
    if launcher == "spawn":
        world = int(sys.argv[3])
        mp.spawn(_spawned, args=(world, piddir), nprocs=world, join=True)
    else:
        check(None, None, piddir, launcher)


if __name__ == "__main__":
    main()
