"""FSDP2 ``fully_shard`` on tpu tensors matches the same code on CPU with gloo (2 processes)."""

import json

import pytest

import torch

from tests.distributed.harness import run_ranks
from tests.tolerances import loss_rtol, rtol_for, update_rtol

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

CASES = ["mlp:1", "mlp:0", "llama:1", "llama:0:mp"]
# Tolerances (tests/tolerances.py), 5 SGD-with-momentum steps. Longest reductions: the MLP
# (16 -> 32 -> 32 -> 5, batch 8) the MSE over 8 x 5 = 40 outputs; the Llama (dim 32, SwiGLU 48,
# vocab 64, 2 x 8 tokens) its vocabulary 64. Float32 losses and gradients drift like the loss;
# parameters within update_rtol of the update (which is smaller than the parameters).
STEPS, N = 5, {"mlp": 40, "llama": 64}
F32, BF16 = torch.float32, torch.bfloat16
# bf16 compute against torch's CPU bf16 kernels: both round each product's inputs and output
# to bf16 and accumulate in float32 (reduction 1), the Llama's 2 layers deep; float32 master
# weights, so per step (tolerances.py, "Mixed precision"); gradients: forward and backward.
MP_LOSS_RTOL = loss_rtol(BF16, 1, 1, depth=2)
MP_GRAD_RTOL = rtol_for(BF16, 1, depth=2 * 2)


def test_fully_shard_matches_gloo():
    outputs = run_ranks(["tests/distributed/workers/fsdp_worker.py", *CASES], 2, timeout=260)
    for code, log in outputs:
        results = [json.loads(l[len("RESULT "):]) for l in log.splitlines()
                   if l.startswith("RESULT ")]
        assert code == 0 and [r["case"] for r in results] == CASES, log[-4000:]
        for r in results:
            # the unsharded parameters were really freed after every step (storage adaptation)
            assert all(r["freed"]), r
            assert r["grad_count"] == (6 if r["case"].startswith("mlp") else 21), r
            n = N[r["case"].split(":")[0]]
            step_rtol = loss_rtol(F32, STEPS, n)
            if r["case"].endswith(":mp"):
                # FSDP's bf16 compute / fp32 reduction is what the unsharded tpu reference does:
                # only the float32 reductions' order differs
                assert r["ref_loss_rel"] < step_rtol and r["ref_grad_rel"] < step_rtol, r
                # against torch's CPU bf16 kernels only bf16 rounding apart (2^-8 per op)
                assert r["loss_rel"] < MP_LOSS_RTOL and r["grad_rel"] < MP_GRAD_RTOL, r
            else:
                assert r["loss_rel"] < step_rtol and r["grad_rel"] < step_rtol, r
                assert r["param_rel"] < update_rtol(F32, STEPS, n), r
