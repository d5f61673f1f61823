"""One rank of a multi-process SPMD run: FSDP over every device of every process.

Usage: ``spmd_worker.py STEPS [CHECKPOINT_DIR]`` under the launch environment of ``tests/distributed/harness``
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) with
``--xla_force_host_platform_device_count`` set to this process's device count.
``dist.init_process_group("tpu")`` starts ``jax.distributed``, so ``jax.devices()`` lists the
devices of all processes; the compiled step is the same SPMD program in every process, with
parameters, AdamW state and the batch split over all of them. Prints one ``RESULT {json}``
line with the losses; with ``CHECKPOINT_DIR``, then saves a sharded checkpoint there (every
process its own shards).
"""

import json
import sys

import torch
import torch.distributed as dist

import tpu_train
import tpu_train.distributed  # noqa: F401  (registers the "tpu" backend)
from tests.parallel.spmd_model import CFG, batches, init_model, loss_fn


def main(steps: int, checkpoint_dir: str | None = None) -> None:
    dist.init_process_group("tpu")
    import jax

    from tpu_train.compile import compile_train_step
    from tpu_train.models import LLAMA
    from tpu_train.parallel import build_mesh, place_for_step, sharding_plan

    devices = jax.devices()
    model = init_model().to(tpu_train.device(0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    mesh = build_mesh(1, len(devices), 1, split_sizes=LLAMA.split_sizes(CFG))
    step = compile_train_step(model, opt, loss_fn, mesh=mesh, plan=sharding_plan(LLAMA))
    place_for_step(step)
    losses = []
    for batch in batches(steps):
        # Every process feeds the same global batch; the step keeps only its own rows.
        metrics = step({k: v.to(tpu_train.device(0)) for k, v in batch.items()})
        losses.append(float(metrics["loss"]))
    if checkpoint_dir:
        from tpu_train.parallel.sharded_checkpoint import save_sharded

        save_sharded(checkpoint_dir, step)
    print("RESULT " + json.dumps({"rank": dist.get_rank(), "devices": len(devices),
                                  "local_devices": jax.local_device_count(),
                                  "losses": losses, "compilations": len(step.compilations)}),
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
