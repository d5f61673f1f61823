"""The compile layer's side of context parallelism: the batch in the zig-zag layout, the
errors for what it cannot split."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from jax.sharding import Mesh

from tpu_train.compile.context_parallel import ContextParallelError, sequence_split, zigzag_batch
from tpu_train.compile.spmd import PlanError, activation_constraint
from tpu_train.ops.context_attention import zigzag_positions


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
