"""One rank of ``parallelize_per_device`` training: FSDP2 / TP over the tpu group, eager.

Usage: ``per_device_worker.py OUT_DIR CASE [CASE ...]`` with CASE like ``fsdp=4`` or
``tensor=2,fsdp=2/rank0`` (degrees not named are 1; one may be ``-1``; after ``/``, which
checkpoint loads to check: ``all`` (every rank passes the full dicts), ``rank0`` (broadcast from
rank 0), ``both`` (the default) or ``none``). Every rank owns one device
(``tpu:0``). For each case: the tiny Llama of ``spmd_model`` trained for 3 AdamW steps on the
global batch split over the batch axes; the loss averaged over the ranks; the bytes of this
rank's parameter shards; then a checkpoint round trip through the full-state-dict helpers onto
a freshly initialized (different seed) sharded model and optimizer. Rank 0 also runs the same
training unsharded in this one process (the reference, once for all cases). Writes ``OUT_DIR/result-RANK.json``
(a list, one entry per case) and records ``OUT_DIR/pid-RANK`` so a launcher's ranks can be
cleaned up. Launch with ``run_ranks``, ``torch.distributed.run`` or ``tpu_train.launch``.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import tpu_train  # noqa: E402,F401
import tpu_train.distributed  # noqa: E402,F401
from tests.parallel.spmd_model import batches, init_model, loss_fn  # noqa: E402
from tpu_train.models import LLAMA  # noqa: E402
from tpu_train.parallel.per_device import (  # noqa: E402
    full_model_state_dict, full_optimizer_state_dict, load_full_model_state_dict,
    load_full_optimizer_state_dict, parallelize_per_device)

STEPS = 3


def optimizer(model):
    # foreach=False: DTensor parameters take the per-parameter path anyway; the same on both
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)


def step(model, opt, batch, par) -> float:
    """One training step on this rank's share of ``batch``; the loss averaged over ranks."""
    shard = par.batch_rank if par is not None else 0
    shards = par.batch_shards if par is not None else 1
    local = {k: v.chunk(shards)[shard].to("tpu") for k, v in batch.items()}
    loss = loss_fn(model, local)
    opt.zero_grad()
    loss.backward()
    opt.step()
    value = loss.detach().float().cpu().reshape(1)
    if par is not None:
        # ranks of one tensor group hold the same loss: the mean over all is the batch mean
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def sharded_model(degrees, seed=0):
    model = init_model() if seed == 0 else init_model().init_weights(seed=seed)
    model = model.to("tpu")
    par = parallelize_per_device(model, LLAMA, **degrees)
    return model, par, optimizer(model)


def shard_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def equal_trees(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            equal_trees(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal_trees(x, y) for x, y in zip(a, b))
    return a == b


def round_trip(model, opt, degrees, next_batch, par, loads) -> dict:
    """Save full state dicts, load them onto fresh sharded models; compare, take a step."""
    msd = full_model_state_dict(model, rank0_only=False)
    osd = full_optimizer_state_dict(model, opt, rank0_only=False)
    msd0 = full_model_state_dict(model)  # rank 0 only
    osd0 = full_optimizer_state_dict(model, opt)
    rank0 = dist.get_rank() == 0
    out = {"rank0_only_empty_elsewhere": rank0 or (msd0 == {} and osd0 == {}),
           "rank0_matches_all": not rank0 or (equal_trees(msd0, msd) and equal_trees(osd0, osd))}
    # two fresh copies: one loaded from every rank's dicts, one broadcast from rank 0's
    sources = {"all": (msd, osd, False), "rank0": (msd0, osd0, True)}
    for name in loads:
        m_sd, o_sd, from0 = sources[name]
        fresh, fresh_par, fresh_opt = sharded_model(degrees, seed=7)
        load_full_model_state_dict(fresh, m_sd, from_rank0=from0)
        load_full_optimizer_state_dict(fresh, fresh_opt, o_sd, from_rank0=from0)
        out[f"{name}_model_equal"] = equal_trees(full_model_state_dict(fresh, rank0_only=False),
                                                 msd)
        out[f"{name}_optim_equal"] = equal_trees(
            full_optimizer_state_dict(fresh, fresh_opt, rank0_only=False), osd)
        out[f"{name}_next_loss"] = step(fresh, fresh_opt, next_batch, fresh_par)
    out["next_loss"] = step(model, opt, next_batch, par)
    return out


def reference(data) -> list:
    model = init_model().to("tpu")
    opt = optimizer(model)
    return [step(model, opt, b, None) for b in data]


def run_case(case: str) -> dict:
    spec, _, loads = case.partition("/")
    loads = {"": ["all", "rank0"], "both": ["all", "rank0"], "none": []}.get(loads, [loads])
    degrees = {"data": 1, "fsdp": 1, "tensor": 1}
    degrees.update({k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))})
    data = batches(STEPS + 1)
    start = time.perf_counter()
    model, par, opt = sharded_model(degrees)
    losses = [step(model, opt, b, par) for b in data[:STEPS]]
    result = {"case": case, "losses": losses, "shape": par.shape.sizes,
              "batch_rank": par.batch_rank, "shard_bytes": shard_bytes(model),
              "full_bytes": shard_bytes(init_model()),
              "train_s": time.perf_counter() - start}
    start = time.perf_counter()
    if loads:
        result.update(round_trip(model, opt, degrees, data[STEPS], par, loads))
    result["round_trip_s"] = time.perf_counter() - start
    return result


def main():
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    (out_dir / f"pid-{rank}").write_text(str(os.getpid()))
    start = time.perf_counter()
    dist.init_process_group("tpu")
    init_s = time.perf_counter() - start
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "other"
    results = [dict(run_case(case), launcher=launcher, world=dist.get_world_size(),
                    init_s=init_s)
               for case in sys.argv[2:]]
    if rank == 0:  # every case trains on the same batches: one reference, after the cases
        start = time.perf_counter()
        losses = reference(batches(STEPS))
        for result in results:
            result.update(reference=losses, reference_s=time.perf_counter() - start)
    (out_dir / f"result-{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
