"""DTensor and tensor parallelism on tpu tensors (tpu group) vs CPU tensors (gloo group).

1. DTensor basics: ``distribute_tensor``, ``redistribute`` between Shard/Replicate layouts,
   ``full_tensor``, checked against the full tensor.
2. A tiny Llama under ``parallelize_module`` with torchtitan's plan: Rowwise embedding,
   SequenceParallel norms, Colwise q/k/v/w1/w3, Rowwise wo/w2 (reduce-scatter back to the
   sequence shard), Colwise output; 5 SGD steps, the same code on both devices.

Prints ``RESULT {json}`` with the largest relative differences of the losses and the full
gradients, and the DTensor failures.
"""

import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

import tpu_train  # noqa: F401
import tpu_train.distributed  # noqa: F401
from tpu_train.models import Llama, LlamaConfig

STEPS = 5
LLAMA = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                    ffn_hidden_dim=48, max_seq_len=16)


def dtensor_failures(mesh, rank) -> list:
    failures = []
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8) + rank  # src rank 0's wins
    want = full - rank
    sharded = distribute_tensor(full.to("tpu"), mesh, [Shard(0)])
    cases = {
        "Shard(0) local": (sharded.to_local(), want.chunk(mesh.size())[rank]),
        "Shard(0)->Replicate": (sharded.redistribute(mesh, [Replicate()]).to_local(), want),
        "Shard(0)->Shard(1)": (sharded.redistribute(mesh, [Shard(1)]).to_local(),
                               want.chunk(mesh.size(), dim=1)[rank]),
        "full_tensor": (sharded.full_tensor(), want),
        "sum over shards": ((sharded * 2).sum().full_tensor(), want.sum() * 2),
    }
    for name, (got, expected) in cases.items():
        if got.device.type != "tpu" or not torch.equal(got.cpu(), expected):
            failures.append(f"{name}: {got} vs {expected}")
    return failures


def plan(model, mesh) -> None:
    """torchtitan-style TP + sequence parallelism for the Llama blocks."""
    tp = mesh.size()
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            # attention(x, cos, sin, start_pos, cache): only x is a sequence shard
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                            desired_input_layouts=(Replicate(), None, None,
                                                                   None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
        # the heads are split across ranks: each rank's attention sees its share
        block.attention.n_heads //= tp
        block.attention.n_kv_heads //= tp


def run(device, mesh):
    model = Llama(LLAMA).init_weights(seed=0).to(device)
    plan(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    losses, grads = [], []
    for step in range(STEPS):
        # tensor parallelism: every rank of the group sees the same batch
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, LLAMA.vocab_size, (2, 9), generator=g).to(device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        grads.append([p.grad.full_tensor().cpu() for p in model.parameters()])
        opt.step()
        losses.append(loss.item())
    sharded = sum(1 for p in model.parameters() if any(isinstance(pl, Shard)
                                                       for pl in p.placements))
    return losses, grads, sharded


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def main():
    dist.init_process_group("tpu")
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    tpu_mesh = init_device_mesh("tpu", (dist.get_world_size(),))
    cpu_mesh = DeviceMesh.from_group(gloo, "cpu")
    failures = dtensor_failures(tpu_mesh, rank)
    t_losses, t_grads, sharded = run("tpu", tpu_mesh)
    c_losses, c_grads, _ = run("cpu", cpu_mesh)
    print("RESULT " + json.dumps({
        "dtensor_failures": failures,
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(t_losses, c_losses)),
        "grad_rel": max(rel(a, b) for ga, gb in zip(t_grads, c_grads) for a, b in zip(ga, gb)),
        "grad_count": len(t_grads[-1]),
        "sharded_params": sharded,
        "losses": t_losses,
    }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
