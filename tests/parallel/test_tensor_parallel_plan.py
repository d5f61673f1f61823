"""The per-device DTensor plan is derived from the same parameter roles as the SPMD plan."""

import dataclasses

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tpu_train.models import LLAMA, Llama, get_config
from tpu_train.parallel.tensor_parallel import tensor_parallel_plan

from tests.models.toy_family import TOY


def _styles(plan: dict) -> dict:
    """module -> (style, input layouts, output layouts): what parallelize_module applies."""
    return {name: (type(s).__name__, tuple(s.input_layouts), tuple(s.output_layouts))
            for name, s in plan.items()}


def _meta(family, config):
    with torch.device("meta"):
        return family.build(config)


def test_llama_plan_is_megatron_column_then_row():
    config = dataclasses.replace(get_config("debug_tiny"), n_layers=2)
    styles = _styles(tensor_parallel_plan(LLAMA, _meta(LLAMA, config)))
    column = ("ColwiseParallel", (Replicate(),), (Shard(-1),))
    row = ("RowwiseParallel", (Shard(-1),), (Replicate(),))
    expected = {
        "tok_embeddings": ("RowwiseParallel", (Replicate(),), (Replicate(),)),
        "output": ("ColwiseParallel", (Replicate(),), (Replicate(),)),
    }
    for i in range(2):
        expected.update({f"layers.{i}.attention.wq": column, f"layers.{i}.attention.wk": column,
                         f"layers.{i}.attention.wv": column, f"layers.{i}.attention.wo": row,
                         f"layers.{i}.feed_forward.w1": column,
                         f"layers.{i}.feed_forward.w3": column,
                         f"layers.{i}.feed_forward.w2": row})
    assert styles == expected


def test_tied_embeddings_stay_whole():
    config = dataclasses.replace(get_config("debug_tiny"), n_layers=1, tie_embeddings=True)
    plan = tensor_parallel_plan(LLAMA, _meta(LLAMA, config))
    assert "tok_embeddings" not in plan and "output" not in plan
    assert isinstance(plan["layers.0.attention.wq"], ColwiseParallel)


def test_a_family_of_ones_own_gets_its_plan_from_its_roles():
    plan = tensor_parallel_plan(TOY, _meta(TOY, TOY.config("toy_mlp_tiny")))
    assert sorted(plan) == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up",
                            "embed", "head"]
    assert isinstance(plan["blocks.1.up"], ColwiseParallel)
    assert isinstance(plan["blocks.1.down"], RowwiseParallel)
    assert isinstance(plan["embed"], RowwiseParallel)
