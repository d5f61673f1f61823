"""DTensor and ``parallelize_module`` (Colwise/Rowwise/SequenceParallel) on tpu tensors match
the same code on CPU with gloo (2 processes, tiny Llama, 5 steps)."""

import json

import pytest

import torch

from tests.distributed.harness import run_ranks
from tests.tolerances import loss_rtol

# Float32, 5 SGD steps of the worker's tiny Llama (dim 32, SwiGLU 48, vocab 64, 2 x 8 tokens):
# longest reduction the vocabulary 64; losses and gradients drift like the loss.
STEP_RTOL = loss_rtol(torch.float32, 5, 64)

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
        assert result["loss_rel"] < STEP_RTOL and result["grad_rel"] < STEP_RTOL, result
