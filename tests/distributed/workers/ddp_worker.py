"""DDP on tpu tensors (tpu group) vs the same code on CPU tensors (gloo group): 5 steps.

Prints ``RESULT {json}`` with the largest relative differences of losses and gradients.
"""

import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tpu_train  # noqa: F401
import tpu_train.distributed  # noqa: F401


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def run(device, group, rank):
    net = DDP(model().to(device), process_group=group, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(5):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(net(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        grads.append([p.grad.cpu().clone() for p in net.parameters()])
        opt.step()
        losses.append(loss.item())
    return losses, grads


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def main():
    dist.init_process_group("tpu")
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    tpu_losses, tpu_grads = run("tpu", None, rank)
    cpu_losses, cpu_grads = run("cpu", gloo, rank)
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(tpu_losses, cpu_losses))
    grad_rel = max(rel(a, b) for ga, gb in zip(tpu_grads, cpu_grads) for a, b in zip(ga, gb))
    # the gradients really were averaged: rank-local gradients differ, the synced ones agree
    mean = [g.clone() for g in tpu_grads[-1]]
    for g in mean:
        dist.all_reduce(g, group=gloo)
    synced = max(rel(m / dist.get_world_size(), g) for m, g in zip(mean, tpu_grads[-1]))
    print("RESULT " + json.dumps({"loss_rel": loss_rel, "grad_rel": grad_rel,
                                  "synced_rel": synced, "losses": tpu_losses}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
