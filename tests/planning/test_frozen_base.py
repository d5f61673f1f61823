"""The planner's LoRA runs: a frozen base as stored (int8 under ``model.base_dtype=int8``) and
gradients and moments for the adapters only, in its estimate and in the step it analyses."""

from __future__ import annotations

import pytest
import torch

from tests.compile.test_out_of_memory import _config
from tpu_train.models import get_config, param_shapes
from tpu_train.planning import estimate_from_config
from tpu_train.planning.analysis import compiled_step_analysis

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128)
BASE = ["model=debug_tiny", "data.batch_size=8", "data.seq_len=128", "parallel.data=1",
        "recipe=llama_lora", "recipe.lora.rank=4", "recipe.lora.targets=[wq,wv]"]


def _counted(cfg):
    """(adapter elements, linear weight elements and rows, other elements) by hand."""
    adapters = linear = rows = other = 0
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 2 and not name.startswith("tok_embeddings"):
            linear += shape[0] * shape[1]
            rows += shape[0]
            if name.endswith(("wq.weight", "wv.weight")):
                adapters += 4 * (shape[0] + shape[1])
        else:
            other += shape[0] * (shape[1] if len(shape) == 2 else 1)
    return adapters, linear, rows, other


def test_the_estimate_counts_the_int8_base_and_trains_the_adapters_only():
    adapters, linear, rows, other = _counted(get_config("debug_tiny"))
    lora = estimate_from_config(_config(*BASE), num_devices=1)
    int8 = estimate_from_config(_config(*BASE, "model.base_dtype=int8",
                                        "trainer.precision=bf16"), num_devices=1)
    for r in (lora, int8):
        assert r["trained_params"] == adapters
        assert r["bytes_grads"] == 4 * adapters and r["bytes_optimizer"] == 2 * 4 * adapters
    assert lora["bytes_params"] == 4 * (linear + other + adapters)
    # int8 values and a float32 scale per row; embeddings and norms in bf16 (the compute dtype).
    assert int8["bytes_params"] == linear + 4 * rows + 2 * other + 4 * adapters
    assert estimate_from_config(_config(*BASE, "trainer.precision=bf16"), num_devices=1,
                                changes={"model.base_dtype": "int8"}) == int8


def test_llama_3_1_8b_lora_on_an_int8_base_fits_one_v5e_at_2048_tokens():
    settings = ["model=llama3_1_8b", "recipe=llama_lora", "plan.chip=v5e", "data.seq_len=2048",
                "data.batch_size=1", "parallel.data=1", "trainer.precision=bf16",
                "trainer.remat=full", "trainer.scan_layers=false"]
    int8 = estimate_from_config(_config(*settings, "model.base_dtype=int8"))
    assert int8["fits"] and int8["bytes_total"] < 12 * 2 ** 30
    assert not estimate_from_config(_config(*settings))["fits"]  # a float32 base: 30 GB


@pytest.mark.devices(8)
def test_the_analysed_step_holds_int8_weights_and_adapter_moments_only():
    """XLA's argument bytes of the compiled step: the int8 base's linear weights take 1 byte
    (plus their scales) instead of 4, and no moments are held for them."""
    args = dict(data=8, fsdp=1, tensor=1, batch=8, seq_len=32, overrides=SMALL,
                compute_dtype=torch.bfloat16)
    lora = {"rank": 4, "targets": ["wq", "wv"], "int8": False}
    full = compiled_step_analysis("debug_tiny", **args)
    float_base = compiled_step_analysis("debug_tiny", lora=lora, **args)
    int8_base = compiled_step_analysis("debug_tiny", lora={**lora, "int8": True}, **args)
    adapters, linear, rows, other = _counted(get_config("debug_tiny", **SMALL))
    n = linear + other
    size = "argument_size_in_bytes"
    # Full fine-tuning: weights and two moments for every parameter, 12 bytes each; LoRA on a
    # float32 base: the base's 4 bytes and 12 bytes per adapter value.
    assert full[size] - float_base[size] == 12 * n - (4 * n + 12 * adapters)
    # Int8 base: 1 byte per linear weight, a float32 scale per row, the rest in bf16.
    assert float_base[size] - int8_base[size] == 4 * n - (linear + 4 * rows + 2 * other)
