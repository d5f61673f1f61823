"""torch DDP on tpu tensors matches the same code on CPU with gloo (5 steps, 2 processes)."""

import json

import pytest

import torch

from tests.distributed.harness import run_ranks
from tests.tolerances import loss_rtol, rtol_for

# Float32 (tests/tolerances.py): the worker's MLP (16 -> 32 -> 4, batch 8) has its longest
# reduction in the hidden size 32 and the MSE over 8 x 4 = 32 outputs; 5 SGD steps, losses and
# gradients drift like the loss. The synced check sums 2 ranks' gradients: one reduction of 2.
STEPS, N, WORLD = 5, 32, 2
STEP_RTOL = loss_rtol(torch.float32, STEPS, N)
SYNC_RTOL = rtol_for(torch.float32, WORLD)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]


def test_ddp_matches_gloo():
    outputs = run_ranks(["tests/distributed/workers/ddp_worker.py"], 2, timeout=150)
    for code, log in outputs:
        line = next((l for l in log.splitlines() if l.startswith("RESULT ")), None)
        assert code == 0 and line is not None, log[-3000:]
        result = json.loads(line[len("RESULT "):])
        assert result["loss_rel"] < STEP_RTOL and result["grad_rel"] < STEP_RTOL, result
        assert result["synced_rel"] < SYNC_RTOL, result
