"""Compiled steps whose attention runs the TPU kernels (JAX's Pallas splash attention), here in
Pallas' interpret mode on the CPU client: the path a TPU step takes, traced the same way.

On the chip, a 350M step failed its first call with "Computation compiled for 456 inputs but
called with 446": the kernels' mask tables, built inside one trace and cached, were that
trace's tracers, and a later trace reusing the kernel lowered them as extra parameters of its
program. The test makes a later trace reuse it (a second signature in one process: the layer
body is traced again while the kernel for its length is cached) and checks the losses against
CPU PyTorch; with the tables of that first attempt it fails with the chip's error."""

import copy

import pytest
import torch

from tests.ops.test_attention_tpu import kernel_calls  # noqa: F401  (a fixture)
from tests.tolerances import loss_rtol
from tpu_train.compile import compile_train_step, lower_train_step, targets
from tpu_train.ops import attention_tpu

from .helpers import (DEVICE, OPTIMIZERS, _llama, lm_batches, lm_functions, lm_loss,
                      run_reference, to_device)
from tests.markers import needs_libtpu

SEQ = 128  # one 128-token tile: the smallest the kernels take
# Longest reduction of a step: SwiGLU hidden 256 (dim 128, head_dim 64, 128 tokens, vocab 128).
N = 256


def test_two_signatures_on_the_kernels_run_and_match_cpu(kernel_calls):
    model = _llama(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=128,
                   ffn_hidden_dim=256, max_seq_len=SEQ)
    make_opt = OPTIMIZERS["adamw"]
    # Batch 1 twice, then batch 2: the second signature traces the layer body again while
    # the kernel for 128 tokens is cached from the first.
    batches = lm_batches(2, batch=1, seq=SEQ) + lm_batches(1, batch=2, seq=SEQ, seed=2)
    cpu_losses, *_ = run_reference(model, make_opt, lm_loss, batches, device="cpu",
                                   max_grad_norm=1.0)
    attention_tpu._kernel.cache_clear()
    on_device = copy.deepcopy(model).to(DEVICE)
    step = compile_train_step(on_device, make_opt(on_device.parameters()), lm_loss,
                              max_grad_norm=1.0)
    with attention_tpu.interpreted():
        losses = [float(step(to_device(batch))["loss"].cpu()) for batch in batches]
    assert len(step.compilations) == 2
    # One forward and one backward kernel call per traced layer body, in each compilation.
    assert kernel_calls["forward"] >= 2 and kernel_calls["backward"] >= 2
    for i, (got, want) in enumerate(zip(losses, cpu_losses)):
        rtol = loss_rtol(torch.float32, i + 1, N, functions=lm_functions(2))
        assert abs(got - want) <= rtol * abs(want), (i, got, want)


KERNEL_CALL = 'custom_call_target="tpu_custom_call"'


def _meta_llama(seq: int, batch: int, n_heads: int = 2, n_kv_heads: int = 1):
    from tpu_train.models import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(dim=64 * n_heads, n_layers=1, n_heads=n_heads,
                                  n_kv_heads=n_kv_heads, vocab_size=256,
                                  ffn_hidden_dim=256, max_seq_len=seq))
        tokens = torch.empty(batch, seq, dtype=torch.int64)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), \
        {"tokens": tokens, "labels": tokens.clone()}


@needs_libtpu
def test_a_v5e_step_runs_the_kernels_and_takes_exactly_its_arguments():
    """Compiled for a v5e (compile-only), a bf16 step at 1024 tokens lowers its attention to
    the kernels (forward, dK/dV and dQ: three Pallas calls for one layer), and the program's
    entry parameters are the step's arguments, no more."""
    import jax

    model, optimizer, batch = _meta_llama(1024, 1)
    program = lower_train_step(model, optimizer, lm_loss, batch, target="v5e",
                               autocast_dtype=torch.bfloat16, compute_dtype=torch.bfloat16)
    text = program.executable.as_text()
    assert text.count(KERNEL_CALL) == 3
    entry = text.split("\nENTRY", 1)[1].split("\n}", 1)[0]
    assert entry.count(" parameter(") == len(jax.tree_util.tree_leaves(program.lowered.args_info))


def _partitioned_program(shape, batch, *, n_heads=2, n_kv_heads=1, compile=False):
    from tpu_train.models import LLAMA
    from tpu_train.parallel import sharding_plan

    model, optimizer, tokens = _meta_llama(1024, batch, n_heads=n_heads, n_kv_heads=n_kv_heads)
    mesh = targets.resolve_target("v5e:2x2").mesh(shape, ("data", "fsdp", "tensor"))
    return lower_train_step(model, optimizer, lm_loss, tokens, mesh=mesh,
                            plan=sharding_plan(LLAMA), target="v5e:2x2",
                            autocast_dtype=torch.bfloat16, compute_dtype=torch.bfloat16,
                            compile=compile)


@needs_libtpu
@pytest.mark.parametrize("shape", [(2, 2, 1), (1, 2, 2)])
def test_a_partitioned_step_runs_the_kernels_on_each_device(shape):
    """Over a v5e:2x2 mesh XLA partitions the program but not a Pallas kernel: the kernels run
    in a shard_map, each device on its rows (data x fsdp) and heads (tensor); compiled for the
    target without a chip (the batch-split mesh), the program keeps no [S, S] scores. The mesh
    is laid over the target's own compile-only devices."""
    compile = shape == (2, 2, 1)
    program = _partitioned_program(shape, 4, n_heads=4, n_kv_heads=2, compile=compile)
    assert program.lowered.as_text().count("tpu_custom_call") == 3
    if compile:
        text = program.executable.as_text()
        assert text.count(KERNEL_CALL) == 3
        assert "1024,1024]" not in text  # no scores or probabilities of a row's 1024 tokens


@needs_libtpu
def test_heads_that_do_not_split_keep_the_xla_form():
    """One kv head over tensor=2: no device holds whole heads, so attention takes its XLA
    form, which the partitioner splits as it likes (lowered only)."""
    program = _partitioned_program((2, 1, 2), 2)
    assert "tpu_custom_call" not in program.lowered.as_text()


@needs_libtpu
def test_a_one_device_mesh_keeps_the_kernels():
    """The planner compiles a one-chip step over a mesh of one device: nothing is partitioned,
    so attention takes the kernels, as the trainer's step on that chip does (lowered only)."""
    from tpu_train.models import LLAMA
    from tpu_train.parallel import sharding_plan

    model, optimizer, batch = _meta_llama(1024, 1)
    mesh = targets.resolve_target("v5e:1x1").mesh((1, 1, 1), ("data", "fsdp", "tensor"))
    program = lower_train_step(model, optimizer, lm_loss, batch, mesh=mesh,
                               plan=sharding_plan(LLAMA),
                               target="v5e:1x1", autocast_dtype=torch.bfloat16,
                               compute_dtype=torch.bfloat16, compile=False)
    assert program.lowered.as_text().count("tpu_custom_call") == 3
