"""Planning a training job before renting its chips: per-chip memory, FLOPs and step time.

    tpu-train plan model=llama3_1_8b parallel.fsdp=256 plan.chip=v5e

prints two estimates side by side and one verdict (with the settings that would fit where
the step does not), and writes every figure to a JSON file:

* the analytic model (:mod:`.estimate`): parameters, gradients, AdamW's moments, FSDP's
  working set and activations per chip under the model family's plan, FLOPs from its
  ``flops_per_token``, a step time at an assumed MFU;
* XLA's analysis of the compiled PyTorch step the trainer would run (:mod:`.analysis`):
  compiled by XLA's TPU compiler for the pod's real topology when libtpu is installed
  (``v5e:16x16`` for 256 v5e chips; no chip needed), else by the CPU compiler on virtual CPU
  devices, labelled as such.

:mod:`.command` is the command (``tpu-train plan`` / ``recipe=plan``), :mod:`.report` its one
report formatter. This package sits above ``parallel`` and ``models`` (it plans a named model
under a sharding plan) and below the trainer.
"""

from .analysis import compiled_step_analysis, pod_topology
from .command import plan_job, planning_config, run_plan
from .estimate import (ASSUMED_MFU, CHIPS, Chip, alignment_warnings, estimate,
                       estimate_from_config, get_chip)
from .report import format_report

__all__ = [
    "ASSUMED_MFU",
    "CHIPS",
    "Chip",
    "alignment_warnings",
    "compiled_step_analysis",
    "estimate",
    "estimate_from_config",
    "format_report",
    "get_chip",
    "plan_job",
    "planning_config",
    "pod_topology",
    "run_plan",
]
