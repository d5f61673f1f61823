"""torch DDP on tpu tensors matches the same code on CPU with gloo (5 steps, 2 processes)."""

import json

import pytest

from tests.distributed.harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]


def test_ddp_matches_gloo():
    outputs = run_ranks(["tests/distributed/workers/ddp_worker.py"], 2, timeout=150)
    for code, log in outputs:
        line = next((l for l in log.splitlines() if l.startswith("RESULT ")), None)
        assert code == 0 and line is not None, log[-3000:]
        result = json.loads(line[len("RESULT "):])
        assert result["loss_rel"] < 1e-5 and result["grad_rel"] < 1e-5, result
        assert result["synced_rel"] < 1e-6, result
