"""The trainer: what a training recipe (top-level ``recipes/``) calls, in order:

``start`` (checks, processes, seed, device) → ``assemble`` (one :class:`Run`: tokenizer, data,
model, layout, optimizer, schedule, step, checkpointer) → ``resume`` → ``fit``.

``assemble`` is made of the building blocks of ``setup`` (``build_tokenizer``, ``build_data``,
``build_model``, ``parallelize``, ``build_optimizer``, ``build_scheduler``) and the chosen
:class:`Layout`'s ``build_step``; a recipe that needs another part builds its :class:`Run`
from them.

Attributes load on first use, so that the command line can read the config schema
(``tpu_train.trainer.config``) without importing the device runtime.
"""

from __future__ import annotations

import importlib

_BLOCKS = {
    "Job": "setup", "Data": "setup", "TrainStep": "step", "start": "setup",
    "build_tokenizer": "setup", "build_data": "setup", "build_model": "setup",
    "describe_source": "setup", "parallelize": "setup", "build_optimizer": "setup",
    "build_scheduler": "setup", "Run": "run", "assemble": "run", "resume": "run",
    "fit": "loop", "Layout": "layouts", "ConfigError": "errors",
    "TrainingStopped": "errors", "World": "world",
}

__all__ = sorted(_BLOCKS)


def __getattr__(name: str):
    module = _BLOCKS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
