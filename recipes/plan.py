"""Per-chip memory and step time of a configuration, without the chips.

    tpu-train plan model=llama3_1_8b parallel.fsdp=256 plan.chip=v5e
    tpu-train plan model=llama3_1_70b parallel.fsdp=128 plan.chip=v5p trainer.precision=bf16

Compiles the step the trainer would run (same plan, precision and activation checkpointing)
ahead of time for the requested mesh on virtual devices, and prints XLA's per-chip memory and
FLOPs beside the analytic model.
"""

from omegaconf import DictConfig

from tpu_train.parallel.plan_command import plan_job

RECIPE_CONFIG = "llama_pretrain"


def main(cfg: DictConfig) -> None:
    plan_job(cfg)
