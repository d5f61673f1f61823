"""FSDP2 ``fully_shard`` on tpu tensors (tpu group) vs the same code on CPU tensors (gloo).

Usage: ``fsdp_worker.py CASE [CASE ...]`` with CASE ``MODEL:RESHARD[:mp]`` (MODEL ``mlp`` or
``llama``, RESHARD ``1``/``0`` for ``reshard_after_forward``, ``mp`` for a bf16-param /
fp32-reduce MixedPrecisionPolicy). For every case, 5 SGD-with-momentum steps; prints one
``RESULT {json}`` line per case with the largest relative differences of the losses and of
the full (unsharded) gradients, and whether FSDP really freed the unsharded parameters.

SGD, not Adam: Adam divides by the gradient's running RMS, which turns float32 rounding noise
in near-zero gradients into full-size updates, so after one step the runs would differ by far
more than anything FSDP does.

In bf16 the tpu ops and torch's CPU kernels round differently (e.g. where a CPU kernel keeps
float32 intermediates), ~1e-2 apart, so the mixed-precision case has a second oracle: the
same bf16 computation on the tpu device without FSDP (float32 master weights, a bf16 copy for
compute, float32 gradients averaged over the ranks with gloo), which FSDP must match exactly
up to float32 rounding.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import tpu_train  # noqa: F401
import tpu_train.distributed  # noqa: F401
from tpu_train.device import storage_of
from tpu_train.models import Llama, LlamaConfig

STEPS = 5
LLAMA = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                    ffn_hidden_dim=48, max_seq_len=16)


def build(kind: str) -> torch.nn.Module:
    if kind == "mlp":
        torch.manual_seed(0)
        # 5 output rows: an uneven shard (3 + 2 rows), exercising FSDP2's padding path.
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                   torch.nn.Linear(32, 32), torch.nn.GELU(),
                                   torch.nn.Linear(32, 5))
    return Llama(LLAMA).init_weights(seed=0)


def batch(kind: str, step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    if kind == "mlp":
        return torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def shard(model: torch.nn.Module, kind: str, mesh, reshard: bool, mp: bool) -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mp else MixedPrecisionPolicy()
    blocks = [m for m in model if isinstance(m, torch.nn.Linear)] if kind == "mlp" \
        else list(model.layers)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)


def loss_of(model, kind, x, y):
    out = model(x)
    if kind == "mlp":
        return torch.nn.functional.mse_loss(out.float(), y)
    return torch.nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())


def unsharded_freed(model) -> bool:
    """After a step with resharding, every tpu all-gather buffer is empty (freed)."""
    from tpu_train.device.tensor import TpuTensor

    found = False
    for state in _fsdp_params(model):
        for tensor in state.all_gather_outputs:
            if isinstance(tensor, TpuTensor):
                found = True
                if storage_of(tensor).numel != 0:
                    return False
    return found


def _fsdp_params(model):
    for module in model.modules():
        get = getattr(module, "_get_fsdp_state", None)
        group = get()._fsdp_param_group if get is not None else None
        if group is not None:
            yield from group.fsdp_params


def run(kind, device, mesh, rank, reshard, mp):
    model = build(kind).to(device)
    shard(model, kind, mesh, reshard, mp)
    opt = optimizer(model)
    losses, grads, freed = [], [], []
    for step in range(STEPS):
        x, y = batch(kind, step, rank)
        loss = loss_of(model, kind, x.to(device), y.to(device))
        opt.zero_grad()
        loss.backward()
        freed.append(unsharded_freed(model))
        grads.append([p.grad.full_tensor().float().cpu() for p in model.parameters()])
        opt.step()
        losses.append(loss.item())
    params = [p.detach().full_tensor().float().cpu() for p in model.parameters()]
    return losses, grads, params, freed


def optimizer(model):
    # foreach=False: the per-parameter path, identical on both sides
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)


def mp_reference(kind, rank, gloo):
    """Mixed precision without FSDP on the tpu device; see the module docstring."""
    world = dist.get_world_size()
    master = build(kind).to("tpu")
    compute = build(kind).to(torch.bfloat16).to("tpu")  # bf16 buffers too, as FSDP casts inputs
    opt = optimizer(master)
    losses, grads = [], []
    for step in range(STEPS):
        with torch.no_grad():
            for low, high in zip(compute.parameters(), master.parameters()):
                low.copy_(high)
                low.grad = None
        x, y = batch(kind, step, rank)
        x = x.to(torch.bfloat16) if x.is_floating_point() else x
        loss = loss_of(compute, kind, x.to("tpu"), y.to("tpu"))
        loss.backward()
        step_grads = []
        for low, high in zip(compute.parameters(), master.parameters()):
            grad = low.grad.float().cpu()
            dist.all_reduce(grad, group=gloo)
            step_grads.append(grad / world)
            high.grad = step_grads[-1].to("tpu")
        grads.append(step_grads)
        opt.step()
        losses.append(loss.item())
    return losses, grads


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def mp_comparison(kind, rank, gloo, losses, grads):
    r_losses, r_grads = mp_reference(kind, rank, gloo)
    return {"ref_loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, r_losses)),
            "ref_grad_rel": max(rel(a, b) for ga, gb in zip(grads, r_grads)
                                for a, b in zip(ga, gb))}


def main():
    dist.init_process_group("tpu")
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    tpu_mesh = init_device_mesh("tpu", (dist.get_world_size(),))
    cpu_mesh = DeviceMesh.from_group(gloo, "cpu")
    for case in sys.argv[1:]:
        kind, reshard, *extra = case.split(":")
        reshard, mp = reshard == "1", "mp" in extra
        t_losses, t_grads, t_params, freed = run(kind, "tpu", tpu_mesh, rank, reshard, mp)
        c_losses, c_grads, c_params, _ = run(kind, "cpu", cpu_mesh, rank, reshard, mp)
        print("RESULT " + json.dumps({
            "case": case,
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(t_losses, c_losses)),
            "grad_rel": max(rel(a, b) for ga, gb in zip(t_grads, c_grads)
                            for a, b in zip(ga, gb)),
            "param_rel": max(rel(a, b) for a, b in zip(t_params, c_params)),
            "grad_rel_per_step": [max(rel(a, b) for a, b in zip(ga, gb))
                                  for ga, gb in zip(t_grads, c_grads)],
            "grad_count": len(t_grads[-1]),
            **(mp_comparison(kind, rank, gloo, t_losses, t_grads) if mp else {}),
            "freed": freed,
            "losses": t_losses,
            "losses_moved": abs(t_losses[-1] - t_losses[0]) > 1e-4,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
