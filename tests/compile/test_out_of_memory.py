"""A step too large for its chip: XLA's out-of-memory compile is one line naming the bytes
needed and the chip's, and the trainer adds the settings that would fit (the planner's).

The compile is XLA's TPU compiler for a v5e that is not attached (``target="v5e"``, libtpu;
CI installs it): it fails at buffer assignment as on a chip, before generating code.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpu_train.compile import ProgramOutOfMemoryError, lower_train_step
from tpu_train.compile.memory_errors import out_of_memory
from tpu_train.models import Llama, LlamaConfig
from tests.markers import needs_libtpu

GiB = 2**30
# XLA:TPU's message (jax 0.10.2's libtpu), compiling 350m-sized layers for 160 x 1024 tokens.
TEMPORARIES = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
               "temporaries (22.93G) exceeds available HBM (15.75G).\n\nLargest program "
               "allocations in hbm:\n ...")


def test_xla_messages_are_parsed():
    found = out_of_memory(RuntimeError(TEMPORARIES), argument_bytes=2 * GiB)
    assert found.needed_bytes == int(22.93 * GiB) + 2 * GiB
    assert found.capacity_bytes == int(15.75 * GiB)
    assert str(found) == ("the compiled train step needs 24.93 GiB of HBM per chip (22.93 GiB "
                          "of temporaries, 2.00 GiB of parameters, optimizer state and batch), "
                          "which has 15.75 GiB")
    used = out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran "
                                      "out of memory in memory space hbm. Used 16.10G of 15.75G "
                                      "hbm. Exceeded hbm capacity by 356.41M."))
    assert (used.needed_bytes, used.capacity_bytes) == (int(16.10 * GiB), int(15.75 * GiB))
    assert out_of_memory(RuntimeError("INVALID_ARGUMENT: something else")) is None
    unknown = out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: no figures"))
    assert unknown.needed_bytes is None and "RESOURCE_EXHAUSTED: no figures" in str(unknown)


@needs_libtpu
def test_an_out_of_memory_compile_is_one_line():
    # One small layer over 256 x 2048 tokens (measured: 16.7 GiB of temporaries).
    config = LlamaConfig(dim=128, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=256,
                         ffn_hidden_dim=256, max_seq_len=2048)
    with torch.device("meta"):
        model = Llama(config)
        tokens = torch.empty(256, 2048, dtype=torch.int64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn(m, b):
        return F.cross_entropy(m(b["tokens"]).flatten(0, 1), b["labels"].flatten())

    with pytest.raises(ProgramOutOfMemoryError) as raised:
        lower_train_step(model, optimizer, loss_fn, {"tokens": tokens, "labels": tokens},
                         target="v5e")
    error = raised.value
    assert error.capacity_bytes == int(15.75 * GiB)  # a v5e chip's HBM, as XLA names it
    assert error.needed_bytes > error.capacity_bytes
    assert "\n" not in str(error) and str(error).startswith("the compiled train step needs ")
    assert error.__cause__ is None and error.__suppress_context__


def _config(*overrides: str):
    from hydra import compose, initialize_config_dir

    from tpu_train import cli
    from tpu_train.trainer.config import register_schema

    register_schema()
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_the_trainer_names_settings_that_fit():
    """A 1B Llama at 4 x 2048 tokens on one v5e that needed 5 % more than the chip: the
    planner's estimates, scaled to XLA's figure, name the settings that fit: AdamW's moments
    in bf16 first (half their bytes, no slower), then the remat policies."""
    from tpu_train.planning.estimate import estimate_from_config
    from tpu_train.planning.fit import out_of_memory_message, settings_that_fit

    config = _config("model=llama3_2_1b", "data.batch_size=4", "data.seq_len=2048",
                     "parallel.data=1", "trainer.precision=bf16")
    capacity = int(15.75 * GiB)
    needed = int(1.05 * capacity)
    fitting = settings_that_fit(config, needed, capacity, num_devices=1)
    assert fitting and fitting[0].startswith("optim.state_dtype=bf16 (~"), fitting
    assert fitting[1].startswith("trainer.remat=save_dots (~"), fitting
    scale = needed / estimate_from_config(config, num_devices=1)["bytes_total"]
    for line in fitting:
        overrides, predicted = line.split(" (~")
        changes = dict(o.split("=") for o in overrides.split())
        figures = estimate_from_config(config, num_devices=1, changes=changes)
        assert figures["bytes_total"] * scale <= capacity
        assert predicted == f"{figures['bytes_total'] * scale / GiB:.2f} GiB)"
    error = ProgramOutOfMemoryError(needed, capacity, "hbm", "RESOURCE_EXHAUSTED: ...")
    message = out_of_memory_message(error, config, num_devices=1)
    assert "\n" not in message
    assert message.startswith("the compiled train step needs 16.54 GiB of HBM per chip, which "
                              "has 15.75 GiB; settings that would fit (planner's estimate): "
                              "optim.state_dtype=bf16 (~"), message
    # Recomputing everything, one row at once: the bf16 storage of the moments, then of the
    # weights (and so of their moments) is what is left to try, and the layers' inputs in host
    # memory beside the bf16 moments (offload needs the layers scanned).
    tight = ["model=llama3_2_1b", "data.batch_size=1", "data.seq_len=2048", "parallel.data=1",
             "trainer.remat=full"]
    assert out_of_memory_message(error, _config(*tight), 1).endswith(
        "settings that would fit (planner's estimate): optim.state_dtype=bf16 (~13.29 GiB), "
        "trainer.param_dtype=bf16 (~10.05 GiB), optim.state_dtype=bf16 trainer.remat=offload "
        "trainer.scan_layers=true (~15.67 GiB)")
    # With both already in bf16, nothing smaller to try.
    narrow = _config(*tight, "trainer.param_dtype=bf16", "optim.state_dtype=bf16")
    assert "shard the model over more chips" in out_of_memory_message(error, narrow, 1)


def test_the_cli_reports_it_in_one_line(monkeypatch, tmp_path):
    from tpu_train.compile import CompiledTrainStep

    from tests.trainer.cli_helpers import (TINY_COMPILED, assert_one_line_out_of_memory,
                                           run_in_process)

    def too_large(self, *args, **kwargs):
        raise ProgramOutOfMemoryError(int(20 * GiB), int(15.75 * GiB), "hbm", "RESOURCE_EXHAUSTED")

    monkeypatch.setattr(CompiledTrainStep, "__call__", too_large)
    code, _, err = run_in_process(*TINY_COMPILED, "trainer.max_steps=2",
                                  f"run.dir={tmp_path / 'run'}")
    assert_one_line_out_of_memory(code, err)
