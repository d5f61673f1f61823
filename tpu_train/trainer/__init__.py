"""The trainer's building blocks, which recipes (top-level ``recipes/``) assemble in order:

``start`` → ``build_tokenizer`` → ``build_data`` → ``build_model`` → ``parallelize`` →
``build_optimizer`` / ``build_scheduler`` → ``build_train_step`` → ``resume`` → ``fit``.

Attributes load on first use, so that the command line can read the config schema
(``tpu_train.trainer.config``) without importing the device runtime.
"""

from __future__ import annotations

import importlib

_BLOCKS = {
    "Job": "setup", "Data": "setup", "TrainStep": "setup", "start": "setup",
    "build_tokenizer": "setup", "build_data": "setup", "build_model": "setup",
    "describe_source": "setup", "parallelize": "setup", "build_optimizer": "setup",
    "build_scheduler": "setup", "build_train_step": "setup", "resume": "setup",
    "fit": "loop", "Parallelism": "parallelism", "ConfigError": "errors",
    "TrainingStopped": "errors", "World": "world",
}

__all__ = sorted(_BLOCKS)


def __getattr__(name: str):
    module = _BLOCKS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
