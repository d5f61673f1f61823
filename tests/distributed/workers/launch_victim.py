"""Under the launcher: rank 1 fails after start-up while the others wait in a collective."""

import os
import sys
import time

import torch
import torch.distributed as dist

import tpu_train  # noqa: F401
import tpu_train.distributed  # noqa: F401

dist.init_process_group("tpu")
with open(os.path.join(sys.argv[1], f"pid{dist.get_rank()}"), "w") as f:
    f.write(str(os.getpid()))
if dist.get_rank() == 1:
    time.sleep(1)
    sys.exit(7)
x = torch.ones(4, device="tpu")
dist.all_reduce(x)
dist.all_reduce(x)
float(x[0])
