"""``tpu-train plan``: per-chip memory, FLOPs and step time of a config, analytic and from XLA.

:func:`plan_job` is the command (``tpu-train plan ...`` and ``tpu-train recipe=plan ...`` both
reach it). :func:`run_plan` takes a composed ``tpu-train`` config and returns one dict: the
analytic estimate (:func:`tpu_train.planning.estimate.estimate_from_config`) and, beside it,
what XLA says about the *real* compiled PyTorch step for the target mesh
(:mod:`tpu_train.planning.analysis`), compiled in a child process:

* ``plan.chip`` names a TPU generation XLA's TPU compiler knows (v4, v5e, v5p, v6e) and
  libtpu is installed: the TPU compiler, for the pod's topology (256 v5e chips: ``v5e:16x16``;
  ``plan.chip=v5p:4x4x8`` names one): its buffer assignment, read before code generation
  (``plan.fast``, the default: tens of seconds instead of minutes, the memory a lower bound),
  or with ``plan.fast=false`` the finished executable's figures;
* otherwise the CPU compiler on as many virtual CPU devices as the mesh has chips, with a
  one-line note saying why and the report labelling the figures as the CPU compiler's.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from typing import Any

from tpu_train.compile.targets import GENERATIONS, TargetError, libtpu_available

from . import estimate as estimate_mod
from .analysis import CHILD_TIMEOUT_S, analyse_in_child, pod_topology
from .report import format_report

__all__ = ["DEFAULT_MAX_SEQ_LEN", "choose_compiler", "plan_job", "planning_config", "run_plan"]

# data.seq_len: null plans the model's maximum positions up to this: the trainer's cap
# (tpu_train.trainer.config.DEFAULT_MAX_SEQ_LEN; planning sits below the trainer).
DEFAULT_MAX_SEQ_LEN = 2048


def choose_compiler(chip: str | None, num_chips: int) -> tuple[str | None, str | None]:
    """``(TPU target, note)``: the topology XLA's TPU compiler should compile for, or None
    for the CPU compiler, with a one-line note saying why when a chip was named. A bad
    topology in ``chip`` is a :class:`TargetError`."""
    if chip is None:
        return None, None
    generation = estimate_mod.get_chip(chip).name
    if generation not in GENERATIONS:
        return None, (f"XLA's TPU compiler here has no {generation} target: XLA's figures are "
                      f"the CPU compiler's")
    target = pod_topology(chip if ":" in chip else generation, num_chips)
    if not libtpu_available():
        return None, (f"libtpu is not installed (pip install tpu_train[tpu]), so XLA's TPU "
                      f"compiler cannot compile for {target}: XLA's figures are the CPU "
                      f"compiler's")
    return target, None


def _analysis_args(cfg: Any, degrees: dict[str, int], target: str | None) -> dict[str, Any]:
    return dict(model_name=cfg.model.name, checkpoint=cfg.model.checkpoint,
                batch=int(cfg.data.batch_size), seq_len=int(cfg.data.seq_len),
                remat=estimate_mod.remat_of(cfg),
                compute_dtype=estimate_mod.compute_dtype_of(cfg), scan_layers=cfg.trainer.scan_layers,
                target=target, **degrees)


def _compare(result: dict[str, Any], chip: str | None) -> None:
    """XLA's figures relative to the analytic ones: the planner's calibration check."""
    x = result["xla"]
    # The TPU compiler's own total where its log gave it, less the runtime's reserved memory
    # (which the chip's headroom stands for): memory_analysis() counts the temporaries'
    # fragmentation twice (tpu_train.planning.compiler_log).
    peak = x.get("bytes_peak_estimate")
    if x.get("compiler_total_hbm_bytes"):
        peak = x["compiler_total_hbm_bytes"] - x.get("compiler_reserved_hbm_bytes", 0)
    if peak is None:
        return
    result["xla_vs_analytic"] = peak / result["bytes_total"] - 1
    if x.get("flops_per_device"):
        result["xla_flops_vs_analytic"] = (x["flops_per_device"]
                                           / result["hardware_flops_per_chip"] - 1)
    if chip is not None:
        usable = estimate_mod.get_chip(chip).hbm_bytes * (1 - estimate_mod.HEADROOM)
        # A lower bound (plan.fast, the default) can show that a step does not fit, not that
        # it does.
        lower_bound = "compile_until_buffer_assignment" in x.get("seconds", {})
        result["fits_xla"] = None if lower_bound and peak <= usable else peak <= usable


def run_plan(cfg: Any, num_devices: int | None = None, *, xla: bool = True,
             timeout_s: float = CHILD_TIMEOUT_S) -> dict[str, Any]:
    """The plan of composed config ``cfg``: analytic figures, XLA's beside them, a verdict.

    Returns the analytic estimate's dict with ``xla`` (XLA's per-chip memory and FLOPs of the
    compiled step, ``compiler`` saying whose, or an ``xla_error``), ``fits_xla`` (XLA's peak
    within the chip's usable HBM; None where plan.fast's lower bound is), the relative gaps ``xla_vs_analytic`` (memory) and
    ``xla_flops_vs_analytic``, and ``compiler_note`` when the TPU compiler could not be used.
    """
    result = dict(estimate_mod.estimate_from_config(cfg, num_devices))
    if not xla:
        return result
    degrees = {axis: int(result["mesh"][axis]) for axis in ("data", "fsdp", "tensor")}
    target, note = choose_compiler(cfg.plan.chip, result["num_devices"])
    if note:
        result["compiler_note"] = note
    try:
        result["xla"] = analyse_in_child(
            _analysis_args(cfg, degrees, target), num_devices=result["num_devices"],
            timeout_s=timeout_s, until_buffer_assignment=bool(cfg.plan.fast))
    except TargetError:  # libtpu rejected the topology: bad input, one line
        raise
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as err:
        # Reported, never a crash: the analytic figures stand on their own.
        result["xla"] = {"xla_error": f"the compiled step could not be analysed "
                                      f"({' '.join(str(err).split())[-300:]})"}
    _compare(result, cfg.plan.chip)
    return result


def planning_config(cfg: Any) -> tuple[Any, list[str]]:
    """A copy of ``cfg`` that can be planned without devices, and notes on what was changed.

    A ``-1`` degree means "the rest of the chips", but planning has no chips to count: it
    counts as 1, so the chip count is the product of the explicit degrees. A global batch
    that does not split over ``data * fsdp`` (the trainer's default of 8 sequences cannot
    split over 256 chips) is raised to the next multiple, i.e. at least one sequence per
    batch shard.
    """
    planned = copy.deepcopy(cfg)
    notes = []
    if "seq_len" in planned.data and planned.data.seq_len is None:  # as the trainer resolves it
        model_max = int(estimate_mod.planned_model(planned.model.name,
                                                   planned.model.checkpoint).max_seq_len)
        planned.data.seq_len = min(model_max, DEFAULT_MAX_SEQ_LEN)
        notes.append(f"data.seq_len=null: planning with {planned.data.seq_len} tokens")
    for axis in ("data", "fsdp", "tensor"):
        if int(planned.parallel[axis]) == -1:
            planned.parallel[axis] = 1
    shards = int(planned.parallel.data) * int(planned.parallel.fsdp)
    batch = int(planned.data.batch_size)
    if batch < 1:
        raise ValueError(f"data.batch_size must be >= 1, got {batch}")
    if shards >= 1 and batch % shards:
        planned.data.batch_size = -(-batch // shards) * shards
        notes.append(f"data.batch_size={batch} does not split over data * fsdp = {shards} "
                     f"chips: planning with {planned.data.batch_size} (set data.batch_size "
                     f"to a multiple of {shards} to plan another)")
    return planned, notes


def plan_job(cfg: Any, *, out=None) -> dict[str, Any]:
    """``tpu-train plan``: plan ``cfg``, print the report and one JSON line, return the dict."""
    out = out if out is not None else sys.stdout
    planned, notes = planning_config(cfg)
    start = time.perf_counter()
    result = run_plan(planned)
    result["plan_seconds"] = time.perf_counter() - start
    result["notes"] = notes + ([result["compiler_note"]] if "compiler_note" in result else [])
    print(format_report(result), file=out)
    print(json.dumps(result, default=str), file=out)
    return result
