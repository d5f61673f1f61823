"""``lower_train_step``: the step's program lowered and analysed, never run."""

import torch

import tpu_train  # noqa: F401
from tpu_train.compile import compile_train_step, lower_train_step

from .helpers import DEVICE, mlp, mlp_batches, mlp_loss


def test_lowering_a_tpu_model_runs_nothing_and_matches_the_compiled_step():
    model = mlp().to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {k: v.to(DEVICE) for k, v in mlp_batches(1)[0].items()}
    before = [p.detach().cpu().clone() for p in model.parameters()]
    program = lower_train_step(model, optimizer, mlp_loss, batch)
    figures = program.analysis()
    assert figures["argument_size_in_bytes"] > 0 and figures["flops_per_device"] > 0
    assert set(program.seconds) == {"trace", "lower", "compile"}
    assert all(torch.equal(b, p.detach().cpu()) for b, p in zip(before, model.parameters()))
    step = compile_train_step(model, optimizer, mlp_loss)
    step(batch)
    (compiled,) = step.cache.entries.values()
    # One lowering path: the same program (shardings are annotated differently for abstract
    # inputs than for arrays, so the figures are compared, not the text).
    assert compiled.analysis() == figures


def test_a_meta_model_and_batch_lower_without_allocating():
    with torch.device("meta"):
        model = mlp()
        batch = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in mlp_batches(1)[0].items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    program = lower_train_step(model, optimizer, mlp_loss, batch, compile=False)
    assert program.executable is None and "func.func" in program.lowered.as_text()
    assert all(p.device.type == "meta" for p in model.parameters())
