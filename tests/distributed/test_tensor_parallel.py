"""DTensor and ``parallelize_module`` (Colwise/Rowwise/SequenceParallel) on tpu tensors match
the same code on CPU with gloo (2 processes, tiny Llama, 5 steps)."""

import json

import pytest

from tests.distributed.harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]


def test_tensor_parallel_llama_matches_gloo():
    outputs = run_ranks(["tests/distributed/workers/tp_worker.py"], 2, timeout=170)
    for code, log in outputs:
        line = next((l for l in log.splitlines() if l.startswith("RESULT ")), None)
        assert code == 0 and line is not None, log[-4000:]
        result = json.loads(line[len("RESULT "):])
        assert result["dtensor_failures"] == [], result
        # every Linear and the embedding are sharded (2 layers x 7 + embedding + output)
        assert result["sharded_params"] == 16 and result["grad_count"] == 21, result
        assert result["loss_rel"] < 1e-5 and result["grad_rel"] < 1e-5, result
