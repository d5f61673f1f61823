"""The planner counts AdamW's moments at ``optim.state_dtype`` and the weights at
``trainer.param_dtype``, in its analytic estimate and in the compiled step it analyses."""

from __future__ import annotations

import pytest
import torch

from tests.compile.test_out_of_memory import _config
from tpu_train.models import get_config, num_params
from tpu_train.planning import estimate_from_config
from tpu_train.planning.analysis import compiled_step_analysis

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=128)


def test_the_estimate_counts_moments_and_weights_at_their_dtypes():
    base = ["model=debug_tiny", "data.batch_size=8", "data.seq_len=128", "parallel.data=1"]
    n = num_params(get_config("debug_tiny"))
    default = estimate_from_config(_config(*base), num_devices=1)
    moments = estimate_from_config(_config(*base, "optim.state_dtype=bf16"), num_devices=1)
    weights = estimate_from_config(_config(*base, "trainer.param_dtype=bf16"), num_devices=1)
    assert default["bytes_params"] == default["bytes_grads"] == 4 * n
    assert default["bytes_optimizer"] == 2 * 4 * n
    assert moments["bytes_optimizer"] == 2 * 2 * n  # half: 2 bytes a value
    assert moments["bytes_params"] == 4 * n
    assert default["bytes_total"] - moments["bytes_total"] == 4 * n
    # bf16 weights: their gradients and (as torch keeps them) their moments are bf16 too.
    assert weights["bytes_params"] == weights["bytes_grads"] == 2 * n
    assert weights["bytes_optimizer"] == 2 * 2 * n
    # The same from the settings the fit search tries.
    assert estimate_from_config(_config(*base), num_devices=1,
                                changes={"optim.state_dtype": "bf16"}) == moments


@pytest.mark.devices(8)
def test_the_analysed_step_holds_bf16_moments():
    """XLA's argument bytes of the compiled step (8 data-parallel replicas, each holding the
    whole state): the moments in bf16 take 2 x 2 bytes a parameter fewer."""
    args = dict(data=8, fsdp=1, tensor=1, batch=8, seq_len=32, overrides=SMALL)
    default = compiled_step_analysis("debug_tiny", **args)
    narrow = compiled_step_analysis("debug_tiny", state_dtype=torch.bfloat16, **args)
    n = num_params(get_config("debug_tiny", **SMALL))
    assert default["argument_size_in_bytes"] - narrow["argument_size_in_bytes"] == 2 * 2 * n
