"""A training-like loop of all-reduces where one rank dies (``die``) or hangs (``hang``)."""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import tpu_train  # noqa: F401
import tpu_train.distributed  # noqa: F401


def main():
    mode, victim = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("tpu")
    rank = dist.get_rank()
    x = torch.ones(1024, device="tpu")
    for step in range(1000):
        if rank == victim and step == 3:
            print(f"rank {rank} {mode}s at step {step}", flush=True)
            if mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:  # hang: alive, heartbeating, never reaching the next collective
                time.sleep(1)
        dist.all_reduce(x)
        x.div_(dist.get_world_size())
        float(x[0])  # a read each step, as a loss.item() would
    print("finished", flush=True)


if __name__ == "__main__":
    main()
