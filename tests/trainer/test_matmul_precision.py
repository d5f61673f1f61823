"""``trainer.matmul_precision`` reaches the float32 dots the run compiles."""

import jax
import torch

from tests.trainer.cli_helpers import run_in_process
from tpu_train.device import runtime
from tpu_train.ops import matmul

SHORT = ("model=debug_tiny", "trainer.max_steps=1", "trainer.val_every_n_steps=0",
         "logging.progress_bar=false", "data.batch_size=8", "data.seq_len=16")


def _dot_precisions() -> str:
    runtime.devices()  # the platform chosen as the trainer chooses it, before JAX starts
    lowered = jax.jit(lambda x, y: matmul.dot_general(x, y, ((1,), (0,)), ((), ()))).lower(
        jax.ShapeDtypeStruct((8, 16), jax.numpy.float32),
        jax.ShapeDtypeStruct((16, 4), jax.numpy.float32))
    return lowered.as_text()


def test_a_runs_matmul_precision_reaches_the_dots(tmp_path):
    assert "HIGHEST" in _dot_precisions()  # PyTorch's default level before the run
    code, _, err = run_in_process(*SHORT, "trainer.matmul_precision=medium",
                                  f"run.dir={tmp_path / 'run'}")
    assert code == 0, err
    assert matmul.get_matmul_precision() == "medium"
    assert torch.get_float32_matmul_precision() == "highest"  # PyTorch's CPU matmuls as they were
    text = _dot_precisions()
    assert "DEFAULT" in text and "HIGHEST" not in text
