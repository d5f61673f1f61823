"""The compile layer's side of context parallelism: the batch in the zig-zag layout, the
errors for what it cannot split."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from jax.sharding import Mesh

from tpu_train.compile import targets
from tpu_train.compile.context_parallel import ContextParallelError, sequence_split, zigzag_batch
from tpu_train.compile.spmd import PlanError, activation_constraint
from tpu_train.ops.context_attention import zigzag_positions
from tests.markers import needs_libtpu


def test_the_batch_is_permuted_and_keeps_its_positions():
    tokens = torch.arange(2 * 16).reshape(2, 16)
    labels = tokens + 100
    out = zigzag_batch({"tokens": tokens, "labels": labels, "weight": torch.ones(3)}, 4)
    order = torch.as_tensor(zigzag_positions(16, 4))
    assert torch.equal(out["tokens"], tokens[:, order])
    assert torch.equal(out["labels"], labels[:, order])  # each label stays with its token
    assert torch.equal(out["position_ids"], order.expand(2, 16))
    assert torch.equal(out["weight"], torch.ones(3))


def test_packed_rows_and_uneven_sequences_are_refused():
    tokens = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ContextParallelError, match="set data.packing=false"):
        zigzag_batch({"tokens": tokens, "segment_ids": tokens}, 2)
    with pytest.raises(ContextParallelError, match="2 x parallel.context = 6 equal chunks"):
        zigzag_batch({"tokens": tokens}, 3)


@pytest.mark.devices(8)
def test_a_plan_without_a_sequence_rule_is_refused():
    class Plan:
        name = "other_plan"

        @staticmethod
        def activation_rule(model, batch_shape):
            return None

    devices = np.asarray(jax.devices()[:8]).reshape(1, 4, 2, 1)
    mesh = Mesh(devices, ("data", "fsdp", "context", "tensor"))
    batch = [torch.empty(4, 16, device="meta")]
    with pytest.raises(PlanError, match="other_plan does not support context parallelism"):
        activation_constraint(Plan(), mesh, None, batch)


@pytest.mark.devices(8)
def test_a_sliding_window_shorter_than_the_sequence_is_refused():
    devices = np.asarray(jax.devices()[:8]).reshape(1, 4, 2, 1)
    mesh = Mesh(devices, ("data", "fsdp", "context", "tensor"))
    # Its mask follows the tokens' order, which the zig-zag layout changes.
    with pytest.raises(ContextParallelError, match="sliding window of 8"):
        sequence_split(mesh, [(4, 16)], window=8)
    with sequence_split(mesh, [(4, 16)], window=16):  # the window cuts nothing
        pass


@needs_libtpu
def test_a_v5e_step_runs_each_devices_share_on_the_kernels():
    """Compiled for a v5e:2x2 (compile-only) with context=2 x fsdp=2, a bf16 step at 1024
    tokens runs each device's share of attention on the splash kernels: forward, dQ and dK/dV
    kernels, on the device's 512 queries against the 1024 gathered keys, and no blockwise
    loop over blocks of keys."""
    from tpu_train.compile import lower_train_step
    from tpu_train.models import LLAMA, Llama, LlamaConfig
    from tpu_train.parallel import sharding_plan

    seq = 1024
    with torch.device("meta"):
        model = Llama(LlamaConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256,
                                  ffn_hidden_dim=256, max_seq_len=seq))
        tokens = torch.empty(2, seq, dtype=torch.int64)
    mesh = targets.resolve_target("v5e:2x2").mesh((1, 2, 2, 1),
                                                  ("data", "fsdp", "context", "tensor"))
    program = lower_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               lambda m, b: m(b["tokens"]).float().mean(),
                               {"tokens": tokens}, mesh=mesh, plan=sharding_plan(LLAMA),
                               target="v5e:2x2", autocast_dtype=torch.bfloat16,
                               compute_dtype=torch.bfloat16)
    text = program.executable.as_text()
    kernels = {line.split("=", 1)[0].strip(): line for line in text.splitlines()
               if 'custom_call_target="tpu_custom_call"' in line}
    names = " ".join(kernels)
    assert all(f"splash_mqa_{kind}" in names for kind in ("fwd", "dq", "dkv")), names
    # Per device: one row (fsdp=2), both kv heads vmapped, 2 query heads each, 512 queries.
    forward = next(line for name, line in kernels.items() if "fwd" in name)
    assert "bf16[2,2,512,64]" in forward, forward[:300]
    dkv = next(line for name, line in kernels.items() if "dkv" in name)
    assert "bf16[2,1024,64]" in dkv, dkv[:300]  # dK over the 1024 gathered keys
    assert " while(" not in text  # no blockwise loop
