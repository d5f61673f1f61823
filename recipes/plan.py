"""Per-chip memory, FLOPs and step time of a configuration, without the chips.

    tpu-train plan model=llama3_1_8b parallel.fsdp=256 plan.chip=v5e
    tpu-train plan model=llama3_1_70b parallel.fsdp=128 plan.chip=v5p trainer.precision=bf16

Compiles the step the trainer would run (same plan, precision and activation checkpointing)
ahead of time for the requested mesh, with XLA's TPU compiler for the pod's topology when
libtpu is installed (else on virtual CPU devices, labelled so), and prints XLA's per-chip
memory and FLOPs beside the analytic model (tpu_train.planning).
"""

from omegaconf import DictConfig

from tpu_train.planning import command

RECIPE_CONFIG = "llama_pretrain"


def main(cfg: DictConfig) -> None:
    command.plan_job(cfg)
