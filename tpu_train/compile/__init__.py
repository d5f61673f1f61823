"""Whole-step compilation: a PyTorch training step (forward, backward, clipping, optimizer)
as one XLA program, with a compile cache and recompilation diagnostics.

    step = compile_train_step(model, optimizer, loss_fn, scheduler=sched, max_grad_norm=1.0)
    metrics = step({"tokens": tokens, "labels": labels})   # {"loss", "grad_norm", "lr"}

Compiled decoding (prefill + the decode loop as one program per shape bucket)::

    decoder = CompiledDecoder(model, StaticCacheDecoding())   # tpu_train.models.generation
    new_tokens = decoder.generate(prompts, max_new_tokens=32, eos_token_id=2)

See ``docs/compile.md``.
"""

import sys

import tpu_train.ops  # noqa: F401  (the op families first, then the compile extras)
import tpu_train.ops.compile_extras  # noqa: F401
from tpu_train.compile.cache import CompileRecord, Signature, describe_changes
from tpu_train.compile.decoding import CompiledDecoder
from tpu_train.compile.functional_optim import UnsupportedOptimizerError
from tpu_train.compile.interpreter import MissingLoweringError, run_graph
from tpu_train.compile.lowering import lower_step, lower_train_step
from tpu_train.compile.memory_errors import ProgramOutOfMemoryError
from tpu_train.compile.program import Program
from tpu_train.compile.step_settings import StepSettings
from tpu_train.compile.train_step import CompiledTrainStep, compile_train_step
from tpu_train.compile import dynamo_backend as _dynamo_backend

# torch.compile(model, backend="tpu"): an installed tpu_train declares the backend as an entry
# point, which torch loads on the first such call. Registering it here would import dynamo, a
# quarter of a training job's import time, which a job that never calls torch.compile does not
# need; only where dynamo is already loaded is it registered now (a checkout used without
# ``pip install`` calls ``dynamo_backend.register()`` itself).
_dynamo_backend.install_traceable_protocol()
if "torch._dynamo" in sys.modules:
    _dynamo_backend.register()

__all__ = [
    "CompileRecord",
    "CompiledDecoder",
    "CompiledTrainStep",
    "MissingLoweringError",
    "Program",
    "ProgramOutOfMemoryError",
    "Signature",
    "StepSettings",
    "UnsupportedOptimizerError",
    "compile_train_step",
    "describe_changes",
    "lower_step",
    "lower_train_step",
    "run_graph",
]
