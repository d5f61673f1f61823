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

The report states one verdict for ``plan.chip`` and the figure it rests on (:func:`verdict`):
XLA's TPU compiler's where it compiled the step (a step too large for the chip is its
out-of-memory report, not an error), else the analytic estimate. A step that does not fit
comes with the settings that would (:mod:`.fit`), each a ``tpu-train plan`` command line to
check it. Every figure goes to a JSON file (``plan.output``, else
``runs/plan/<time>/plan.json``), whose path the report ends with.
"""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from tpu_train.compile.targets import GENERATIONS, TargetError, libtpu_available

from . import estimate as estimate_mod
from . import fit
from .analysis import CHILD_TIMEOUT_S, analyse_in_child, pod_topology
from .frozen_base import analysis_args, frozen_base_of
from .report import format_fitting, format_report
from .step_time import get_rates

__all__ = ["DEFAULT_MAX_SEQ_LEN", "FAST_MARGIN", "PLAN_SEQ_LEN_CAP", "choose_compiler",
           "command_line", "plan_job", "planning_config", "run_plan", "verdict", "write_plan"]

# data.seq_len: null plans the model's maximum positions up to this: the trainer's cap
# (tpu_train.trainer.config.DEFAULT_MAX_SEQ_LEN; planning sits below the trainer).
DEFAULT_MAX_SEQ_LEN = 2048
# data.seq_len not on the command line (the bundled corpus's 128 tokens say nothing of a pod
# run): the plan takes the model's context, at most this.
PLAN_SEQ_LEN_CAP = 4096
# plan.fast reads XLA's buffer assignment, a lower bound: the finished executable's own total
# was 3-7 % above it for Llama-3.1-8B and 70B (docs/compile.md), so a verdict adds the most.
FAST_MARGIN = 0.07
# Settings that would fit: found by the analytic model, at most this many compiled to check
# (each a compile of the whole step; plan.checks), at most _SHOWN printed.
CHECKED_MOST = 3
_CANDIDATES = 8
_SHOWN = 3


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


def _stored(cfg: Any, key: str):
    return estimate_mod.stored_dtype(estimate_mod.setting(cfg, key))


def _num_slices(cfg: Any) -> int:
    return int(estimate_mod.setting(cfg, "plan.num_slices") or 1)


def _analysis_args(cfg: Any, degrees: dict[str, int], target: str | None) -> dict[str, Any]:
    rows, splits = estimate_mod.pieces(
        cfg, degrees["data"] * degrees["fsdp"] * degrees.get("expert", 1))
    param_bytes = estimate_mod.stored_bytes(estimate_mod.setting(cfg, "trainer.param_dtype")) or 4
    compute = estimate_mod.compute_dtype_of(cfg)
    base = frozen_base_of(cfg, param_bytes, compute.itemsize if compute else None)
    slices = {"num_slices": _num_slices(cfg)} if target is not None and _num_slices(cfg) > 1 \
        else {}
    return dict(model_name=cfg.model.name, checkpoint=cfg.model.checkpoint, **slices,
                overrides=estimate_mod.architecture_overrides(cfg.model),
                batch=rows * splits, grad_accum_steps=splits, seq_len=int(cfg.data.seq_len),
                remat=estimate_mod.remat_of(cfg),
                compute_dtype=estimate_mod.compute_dtype_of(cfg), scan_layers=cfg.trainer.scan_layers,
                param_dtype=_stored(cfg, "trainer.param_dtype"),
                state_dtype=_stored(cfg, "optim.state_dtype"),
                target=target, **analysis_args(base), **degrees)


def _compare(result: dict[str, Any]) -> None:
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


def _step_time_figures(result: dict[str, Any]) -> None:
    """The MFU and tokens/s/chip at the step time predicted from the compiled program."""
    predicted = (result.get("xla") or {}).get("step_time")
    if not predicted or predicted["step_time_s"] <= 0:
        return
    chips, seconds = result["num_devices"], predicted["step_time_s"]
    predicted["mfu"] = (result["model_flops_per_step"] / chips / seconds
                        / get_rates(predicted["chip"]).bf16_flops)
    predicted["tokens_per_s_per_chip"] = result["tokens_per_step"] / chips / seconds


def verdict(result: dict[str, Any]) -> dict[str, Any] | None:
    """Whether the step fits on ``result``'s chip, by one figure, and which (``basis``): XLA's
    TPU compiler's where it compiled the step for the chip (its executable's own total, its
    out-of-memory report, or, under ``plan.fast``, its buffer assignment plus
    :data:`FAST_MARGIN`), else the analytic estimate. None without a chip."""
    if "chip" not in result:
        return None
    chip = estimate_mod.get_chip(result["chip"])
    usable = chip.hbm_bytes * (1 - estimate_mod.HEADROOM)
    x = result.get("xla") or {}
    compiler = f"XLA's TPU compiler for {x.get('compiled_for')}"
    if x.get("compiler") == "TPU" and x.get("compiler_total_hbm_bytes"):
        needed = x["compiler_total_hbm_bytes"] - x.get("compiler_reserved_hbm_bytes", 0)
        basis = f"{compiler}, the compiled step's own total"
    elif x.get("compiler") == "TPU" and "out_of_memory" in x and "bytes_peak_estimate" in x:
        needed, basis = x["bytes_peak_estimate"], f"{compiler}, its out-of-memory compile"
    elif x.get("compiler") == "TPU" and "compile_until_buffer_assignment" in x.get("seconds", {}):
        needed = x["bytes_peak_estimate"] * (1 + FAST_MARGIN)
        basis = (f"{compiler}, its buffer assignment + {100 * FAST_MARGIN:.0f} % (the most "
                 f"the compiler's own total has exceeded it by; plan.fast=false: that total)")
    elif x.get("compiler") == "TPU" and "bytes_peak_estimate" in x:
        needed, basis = x["bytes_peak_estimate"], f"{compiler}, its memory analysis"
    else:
        needed = result["bytes_total"]
        basis = ("the analytic estimate (XLA's figures are the CPU compiler's, not the "
                 "chip's)" if "bytes_peak_estimate" in x else "the analytic estimate")
    return {"fits": needed <= usable, "needed_bytes": needed, "usable_bytes": usable,
            "basis": basis, "scaled_to_xla": not basis.startswith("the analytic")}


def run_plan(cfg: Any, num_devices: int | None = None, *, xla: bool = True,
             timeout_s: float = CHILD_TIMEOUT_S) -> dict[str, Any]:
    """The plan of composed config ``cfg``: analytic figures, XLA's beside them, a verdict.

    Returns the analytic estimate's dict (its own verdict as ``fits_analytic``) with ``xla``
    (XLA's per-chip memory and FLOPs of the compiled step, ``compiler`` saying whose, or an
    ``xla_error``), the relative gaps ``xla_vs_analytic`` (memory) and
    ``xla_flops_vs_analytic``, ``compiler_note`` when the TPU compiler could not be used, and
    ``verdict`` (:func:`verdict`), whose ``fits`` is also ``fits``.
    """
    result = dict(estimate_mod.estimate_from_config(cfg, num_devices))
    if "fits" in result:
        result["fits_analytic"] = result.pop("fits")
    if xla:
        degrees = {axis: int(result["mesh"][axis])
                   for axis in ("data", "fsdp", "expert", "context", "tensor")}
        # A multi-slice plan compiles for plan.num_slices slices of one slice's topology.
        target, note = choose_compiler(cfg.plan.chip,
                                       result["num_devices"] // _num_slices(cfg))
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
        _compare(result)
        _step_time_figures(result)
    result["verdict"] = verdict(result)
    if result["verdict"] is not None:
        result["fits"] = result["verdict"]["fits"]
    return result


def planning_config(cfg: Any, *, seq_len_given: bool = True) -> tuple[Any, list[str]]:
    """A copy of ``cfg`` that can be planned without devices, and notes on what was changed.

    ``seq_len_given=False`` (``data.seq_len`` not on the command line): the model's context,
    at most :data:`PLAN_SEQ_LEN_CAP` tokens; ``data.seq_len=null`` is resolved as the trainer
    resolves it. A ``-1`` degree means "the rest of the chips", but planning has no chips to
    count: it counts as 1, so the chip count is the product of the explicit degrees. A global
    batch that does not split over ``data * fsdp`` (the trainer's default of 8 sequences
    cannot split over 256 chips) is raised to the next multiple, i.e. at least one sequence
    per batch shard.
    """
    planned = copy.deepcopy(cfg)
    notes = []
    def model_max() -> int:
        return int(estimate_mod.planned_model(
            planned.model.name, planned.model.checkpoint,
            **estimate_mod.architecture_overrides(planned.model)).max_seq_len)

    if not seq_len_given:
        planned.data.seq_len = min(model_max(), PLAN_SEQ_LEN_CAP)
        notes.append(f"data.seq_len not set: planning {planned.data.seq_len:,} tokens a "
                     f"sequence (the model's context, {model_max():,}, at most "
                     f"{PLAN_SEQ_LEN_CAP:,}; set data.seq_len to plan another)")
    elif "seq_len" in planned.data and planned.data.seq_len is None:  # as the trainer does
        planned.data.seq_len = min(model_max(), DEFAULT_MAX_SEQ_LEN)
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


_FILLED_IN = ("data.seq_len", "data.batch_size", "parallel.data", "parallel.fsdp",
              "parallel.tensor")


_SPELT_OUT = ("model.name", "model.checkpoint", *_FILLED_IN, "trainer.precision",
              "trainer.remat", "trainer.micro_batch_size", "plan.chip")


def command_line_overrides() -> list[str] | None:
    """The overrides of this ``tpu-train`` command line (None outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def command_line(overrides: list[str], changes: dict[str, Any]) -> str:
    """``tpu-train plan`` with ``overrides``, those of ``changes``' keys replaced by it."""
    kept = [o for o in overrides if _key(o) not in changes]
    added = [f"{key}={fit.override_value(value)}" for key, value in changes.items()]
    return shlex.join(["tpu-train", "plan", *kept, *added])


def _with(cfg: Any, changes: dict[str, Any]) -> Any:
    changed = copy.deepcopy(cfg)
    for key, value in changes.items():
        OmegaConf.update(changed, key, value, merge=False)
    return changed


def _fitting(cfg: Any, planned: Any, result: dict[str, Any], overrides: list[str],
             out) -> list[dict[str, Any]]:
    """Settings that would fit where the plan does not, each as a ``tpu-train plan`` line
    (with what the planner filled in made explicit). Predicted from the analytic model scaled
    to XLA's figure, which moves less well across remat policies than within one: where XLA's
    TPU compiler gave the verdict, the candidates are compiled in turn (at most
    ``plan.checks``, default :data:`CHECKED_MOST`) until one fits by its figure."""
    verdict_of = result["verdict"]
    if verdict_of is None or verdict_of["fits"]:
        return []
    filled = {key: estimate_mod.setting(planned, key) for key in _FILLED_IN
              if estimate_mod.setting(planned, key) != estimate_mod.setting(cfg, key)}
    kept = [o for o in overrides if _key(o) != "plan.output"]  # each check writes its own
    found = [{"changes": c.changes, "num_devices": c.num_devices,
              "predicted_bytes": c.predicted_bytes,
              "command": command_line(kept, {**filled, **c.changes})}
             for c in fit.fitting_candidates(planned, verdict_of["needed_bytes"],
                                             verdict_of["usable_bytes"],
                                             result["num_devices"], most=_CANDIDATES,
                                             precision=True)]
    if not verdict_of["scaled_to_xla"]:
        return found[:_SHOWN]
    checks = estimate_mod.setting(cfg, "plan.checks")
    for candidate in found[:CHECKED_MOST if checks is None else max(0, int(checks))]:
        print(f"  compiling {' '.join(fit.Candidate(candidate['changes'], 0, 0).overrides())} "
              f"to check that it fits ...", file=out, flush=True)
        checked_plan = run_plan(_with(planned, candidate["changes"]))
        checked = checked_plan["verdict"]
        candidate["checked"] = bool(checked["fits"] and checked["scaled_to_xla"])
        candidate["checked_bytes"] = checked["needed_bytes"]
        predicted = (checked_plan.get("xla") or {}).get("step_time") or {}
        if "mfu" in predicted:  # the step time of the setting that fits, from its program
            candidate["checked_step_time_s"] = predicted["step_time_s"]
            candidate["checked_mfu"] = predicted["mfu"]
        if candidate["checked"]:
            break
    confirmed = [c for c in found if c.get("checked")]
    return confirmed + [c for c in found if "checked" not in c][:_SHOWN - len(confirmed)] \
        + [c for c in found if c.get("checked") is False]


def _output_path(cfg: Any) -> Path:
    """``plan.output``, or a new ``runs/plan/<time>/plan.json``."""
    chosen = estimate_mod.setting(cfg, "plan.output")
    if chosen:
        path = Path(str(chosen)).expanduser()
        return path / "plan.json" if path.is_dir() else path
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    for attempt in range(100):
        folder = Path("runs", "plan", stamp + (f"_{attempt}" if attempt else ""))
        if not folder.exists():
            return folder / "plan.json"
    raise FileExistsError(f"runs/plan/{stamp}_* exist: set plan.output")


def write_plan(result: dict[str, Any], path: Path) -> None:
    """``result`` as JSON at ``path`` (a whole file or none: written beside it, then moved)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=1, default=str) + "\n")
    partial.replace(path)


def plan_job(cfg: Any, *, out=None, overrides: list[str] | None = None) -> dict[str, Any]:
    """``tpu-train plan``: plan ``cfg``, print the report, write every figure as JSON (to
    ``plan.output``, else ``runs/plan/<time>/plan.json``) and return the dict.
    ``overrides``: the command line's (default: this Hydra job's; without one, the settings
    planned), which decide whether ``data.seq_len`` was given and are repeated in the
    settings that would fit."""
    out = out if out is not None else sys.stdout
    overrides = command_line_overrides() if overrides is None else list(overrides)
    given = overrides is None or any(_key(o) == "data.seq_len" for o in overrides)
    planned, notes = planning_config(cfg, seq_len_given=given)
    if overrides is None:  # no command line: the settings planned, spelt out
        values = {key: estimate_mod.setting(cfg, key) for key in _SPELT_OUT}
        overrides = [f"{key}={getattr(value, 'value', value)}"
                     for key, value in values.items() if value is not None]
    path = _output_path(cfg)
    start = time.perf_counter()
    result = run_plan(planned)
    result["notes"] = notes + ([result["compiler_note"]] if "compiler_note" in result else [])
    print(format_report(result), file=out, flush=True)
    result["fitting"] = _fitting(cfg, planned, result, overrides, out)
    fitting = format_fitting(result)
    if fitting:
        print(fitting, file=out)
    result["plan_seconds"] = time.perf_counter() - start
    write_plan(result, path)
    print(f"plan written to {path} (every figure, JSON)", file=out)
    result["output"] = str(path)
    return result
