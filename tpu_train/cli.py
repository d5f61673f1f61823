"""``tpu-train``: the command line of tpu_train, a Hydra app over the ``configs/`` tree.

Usage::

    tpu-train                                   # recipe=llama_finetune on a tiny Llama, bundled data, CPU
    tpu-train recipe=llama_pretrain trainer.max_steps=500 scheduler=wsd
    tpu-train recipe=llama_lora model=llama3_2_1b model.checkpoint=/ckpt/Llama-3.2-1B \\
              data=jsonl data.path=train.jsonl data.val_path=val.jsonl
    tpu-train recipe=eval run.dir=runs/llama_finetune/2025-01-01_00-00-00
    tpu-train recipe=generate model.checkpoint=runs/llama_finetune/<stamp>/hf \\
              'recipe.generate.prompts=["add 12+30\\n"]'
    tpu-train -m trainer.seed=1,2               # multirun: one run per seed, <run.dir>/<job number>
    tpu-train --cfg job                          # print the composed config and exit
    tpu-train --help                             # recipes and config groups
    tpu-train plan model=llama3_1_8b parallel.fsdp=256 plan.chip=v5e
                                                 # per-chip memory and step time of a pod
                                                 # config: analytic and XLA's, no chips needed

Recipes (``recipe=NAME``; each ``configs/recipe/NAME.yaml`` starts with the command that runs it):

* ``llama_pretrain``: random initialization, WSD schedule; ``model.checkpoint`` must be unset.
* ``llama_finetune`` (default): all parameters train; ``model.checkpoint`` (a Hugging Face
  directory) is loaded parameters-only when set.
* ``llama_lora``: the base model is frozen and ``recipe.lora.{rank,alpha,dropout,targets}``
  adapters wrap the attention and MLP projections; the exported model has them merged.
* ``generate``: greedy or sampled continuations of ``recipe.generate.prompts``.
* ``eval``: validation loss, perplexity and exact match on instruction/chat validation data.

Config groups: ``model`` (debug_tiny, llama3_2_1b, llama3_1_8b, ...), ``data`` (bundled,
jsonl), ``optim`` (adamw, adamw_finetune, adamw_lora),
``scheduler`` (warmup_cosine, wsd, constant), ``parallel``, ``checkpoint``, ``logging``,
``recipe``; plain sections ``trainer`` (max_steps, seed, mode=eager|compiled, device=cpu|tpu,
precision=fp32|bf16, grad_accum_steps, max_grad_norm, activation_checkpointing,
val_every_n_steps, on_nan=stop|skip), ``run`` (dir) and ``plan`` (chip).

Runs: everything a run writes goes under ``run.dir`` (default ``runs/<recipe>/<timestamp>``):
``checkpoints/step_NNNNNNNN/`` (atomic; the last ``checkpoint.keep_last`` are kept),
``tensorboard/``, ``train.log`` and, at the end, ``hf/`` (a Hugging Face export). Starting a
command on a directory that holds a checkpoint resumes it exactly (model, optimizer, schedule,
RNG and data position). SIGINT/SIGTERM save a checkpoint and exit cleanly; a non-finite loss
stops the run (or skips the update with ``trainer.on_nan=skip``) keeping the last good checkpoint.

Errors in the configuration or the data are reported as one line,
``tpu-train: error: ...``, with exit status 2, before anything is written.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from tpu_train.trainer.config import register_schema
from tpu_train.trainer.config_errors import describe_composition_error
from tpu_train.trainer.errors import ConfigError, TrainingStopped

# ``configs/`` sits next to the package (editable install).  Hydra would resolve a relative
# path against the *package* when the app is started from an installed console script, so the
# path is made absolute here.
CONFIG_DIR = str((Path(__file__).resolve().parent / ".." / "configs").resolve())

EXIT_BAD_INPUT = 2
PLAN_COMMAND = "plan"
EXIT_STOPPED = 1


def _run_job(cfg: DictConfig) -> None:
    from tpu_train.recipes import run_recipe

    # Errors are reported here rather than after Hydra's job wrapper, which would print an
    # extra "Error executing job" line first.
    try:
        run_recipe(cfg)
    except Exception as exc:  # noqa: BLE001 - _exit_for re-raises what is not bad input
        _exit_for(exc)


def _run_plan_job(cfg: DictConfig) -> None:
    from tpu_train.parallel.plan_command import plan_job

    try:
        plan_job(cfg)
    except (ValueError, KeyError) as exc:  # bad degrees, batch, chip or model name
        _exit_for(ConfigError(str(exc).strip("'\"")))
    except Exception as exc:  # noqa: BLE001 - _exit_for re-raises what is not bad input
        _exit_for(exc)


def _is_bad_input(exc: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(exc, (ConfigError, HydraException, OmegaConfBaseException)):
        return True
    try:
        from tpu_train.data.errors import DataError
    except ImportError:
        return False
    return isinstance(exc, DataError)


def main() -> None:
    """Console entry point (``tpu-train``)."""
    register_schema()
    # Hydra prints its own multi-line reports unless asked to re-raise; we want one line.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    job, saved_argv = _run_job, sys.argv
    if len(sys.argv) > 1 and sys.argv[1] == PLAN_COMMAND:
        # ``tpu-train plan <overrides>``: the same config tree, a different job; Hydra parses
        # the rest of the command line as usual.
        job, sys.argv = _run_plan_job, [sys.argv[0], *sys.argv[2:]]
    app = hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")(job)
    try:
        app()
    except Exception as exc:  # noqa: BLE001 - _exit_for re-raises what is not bad input
        _exit_for(exc)
    finally:
        sys.argv = saved_argv


def _exit_for(exc: Exception) -> None:
    """Print a one-line report and exit for bad input or a stopped run; re-raise anything else."""
    if isinstance(exc, TrainingStopped):
        print(f"tpu-train: stopped: {exc}", file=sys.stderr)
        sys.exit(EXIT_STOPPED)
    if not _is_bad_input(exc):
        raise exc
    message = str(exc) if isinstance(exc, ConfigError) else describe_composition_error(exc)
    print(f"tpu-train: error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
