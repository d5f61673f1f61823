"""Mixed precision on the tpu device: ``torch.autocast("tpu")`` in eager mode against CPU
autocast, a bf16-autocast compiled step against float32, and the matmul precision setting."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.compile.helpers import DEVICE, lm_loss, mlp, mlp_batches, mlp_loss, tiny_llama
from tests.tolerances import assert_rel_close, loss_rtol, rtol_for
from tpu_train.compile import compile_train_step
from tpu_train.ops import matmul as matmul_mod


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 16, generator=g), torch.randn(16, 8, generator=g),
            torch.randn(3, 4, 16, generator=g), torch.randn(3, 16, 5, generator=g),
            torch.randn(2, 3, 8, 8, generator=g), torch.randn(4, 3, 3, 3, generator=g))


def _lower_precision_ops(a, b, ba, bb, img, kernel):
    return {"mm": a @ b, "linear": F.linear(a, b.t()), "bmm": torch.bmm(ba, bb),
            "matmul": torch.matmul(ba, bb), "addmm": torch.addmm(b[0], a, b),
            "conv2d": F.conv2d(img, kernel)}


def test_eager_lower_precision_ops_match_cpu_autocast():
    cpu_args = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _lower_precision_ops(*cpu_args)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        got = _lower_precision_ops(*(t.to(DEVICE) for t in cpu_args))
    for name, want in expected.items():
        assert want.dtype == torch.bfloat16, name
        assert got[name].dtype == torch.bfloat16, name
        assert got[name].device.type == "tpu"
        # Both multiply bf16-rounded inputs with a float32 accumulator (its error, reduction
        # <= 27, is float32's: negligible); what differs is the output's one bf16 rounding.
        assert_rel_close(got[name], want, rtol_for(torch.bfloat16), name)


def test_eager_float32_ops_and_region_exit():
    x = torch.randn(4, 16).to(DEVICE)
    w = torch.randn(16, 16).to(DEVICE)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        h = x @ w
        assert h.dtype == torch.bfloat16
        # Numerically sensitive ops run in float32 on their bf16 inputs.
        assert torch.softmax(h, -1).dtype == torch.float32
        assert F.layer_norm(h, (16,)).dtype == torch.float32
        assert F.cross_entropy(h, torch.zeros(4, dtype=torch.long).to(DEVICE)).dtype == torch.float32
        # Ops without a rule keep their input dtype.
        assert torch.relu(h).dtype == torch.bfloat16
        # float64 is never cast.
        assert (x.double() @ w.double()).dtype == torch.float64
    assert (x @ w).dtype == torch.float32
    with torch.autocast("tpu", dtype=torch.float16):
        assert (x @ w).dtype == torch.float16


def test_eager_autocast_backward_matches_cpu_autocast():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    lin_tpu = copy.deepcopy(lin).to(DEVICE)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x).float().pow(2).mean().backward()
    with torch.autocast("tpu", dtype=torch.bfloat16):
        lin_tpu(x.to(DEVICE)).float().pow(2).mean().backward()
    # Gradients of float32 parameters flow back through the cast: float32.
    assert lin_tpu.weight.grad.dtype == torch.float32
    # Two chained bf16 products (forward output, backward product), each one bf16 rounding;
    # their sums accumulate in float32.
    grad_rtol = rtol_for(torch.bfloat16, 1, depth=2)
    assert_rel_close(lin_tpu.weight.grad, lin.weight.grad, grad_rtol, "weight.grad")
    assert_rel_close(lin_tpu.bias.grad, lin.bias.grad, grad_rtol, "bias.grad")


def _dot_dtypes(step) -> set:
    """The element types of the matrix products' operands in the step's lowered program(s):
    the forward and the backward, whichever of JAX or PyTorch's traced backward made it."""
    kinds = set()
    for entry in step.cache.entries.values():
        for line in entry.lowered.as_text().splitlines():
            if "stablehlo.dot_general" in line:
                operands = line.rsplit(": (", 1)[1].split(") ->")[0]
                kinds.update(re.findall(r"tensor<(?:[0-9?]+x)*(\w+)>", operands))
    return kinds


def _train_llama(autocast_dtype, steps=20):
    model = tiny_llama().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = compile_train_step(model, opt, lm_loss, autocast_dtype=autocast_dtype)
    g = torch.Generator().manual_seed(3)
    # Two fixed batches, alternated: the model learns them, so the curve has somewhere to go.
    batches = []
    for _ in range(2):
        t = torch.randint(0, 128, (2, 33), generator=g)
        batches.append({"tokens": t[:, :-1].contiguous().to(DEVICE),
                        "labels": t[:, 1:].contiguous().to(DEVICE)})
    losses = [float(step(batches[i % 2])["loss"]) for i in range(steps)]
    return np.array(losses), step, model


def test_bf16_compiled_llama_tracks_float32():
    fp32, step32, _ = _train_llama(None)
    bf16, step16, model16 = _train_llama(torch.bfloat16)
    # The run learns (the comparison below would be vacuous on a flat curve) ...
    assert fp32[-1] < 0.8 * fp32[0], fp32
    # ... and bf16 autocast follows float32 at every step: products rounded to bf16 with
    # float32 accumulation (reduction 1), 2 layers deep, float32 master weights (per step:
    # tests/tolerances.py, "Mixed precision").
    rel = np.abs(bf16 - fp32) / fp32
    assert rel.max() < loss_rtol(torch.bfloat16, 1, 1, depth=2), (rel.max(), fp32, bf16)
    # The products really ran in bf16 (and only with autocast), parameters stayed float32.
    assert _dot_dtypes(step16) == {"bf16"}
    assert _dot_dtypes(step32) == {"f32"}
    assert all(p.dtype == torch.float32 for p in model16.parameters())


def test_active_autocast_region_is_honoured_and_keyed():
    model = mlp().to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compile_train_step(model, opt, mlp_loss)
    batch = {k: v.to(DEVICE) for k, v in mlp_batches(1)[0].items()}
    step(batch)
    assert _dot_dtypes(step) == {"f32"}
    with torch.autocast("tpu", dtype=torch.bfloat16):
        step(batch)
    assert len(step.compilations) == 2
    assert "autocast dtype" in step.compilations[-1].cause
    assert _dot_dtypes(step) == {"f32", "bf16"}
    step(batch)  # outside the region again: the float32 program, no new compilation
    assert len(step.compilations) == 2


def test_bad_autocast_dtype_is_rejected():
    model = mlp().to(DEVICE)
    with pytest.raises(ValueError, match="autocast_dtype"):
        compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_loss,
                           autocast_dtype=torch.float64)


def test_float32_matmul_precision_follows_torch_and_recompiles():
    model = mlp().to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compile_train_step(model, opt, mlp_loss)
    batch = {k: v.to(DEVICE) for k, v in mlp_batches(1)[0].items()}
    assert torch.get_float32_matmul_precision() == "highest"
    try:
        step(batch)
        torch.set_float32_matmul_precision("medium")
        assert matmul_mod.get_matmul_precision() == "medium"
        step(batch)  # traced again: the old program's dots carry the old precision
        assert len(step.compilations) == 2
        assert "matmul precision" in step.compilations[-1].cause
        torch.set_float32_matmul_precision("high")
        assert matmul_mod.get_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")
    assert matmul_mod.get_matmul_precision() == "highest"
