"""``tpu-train plan``: per-chip memory, FLOPs and step time of a config, analytic and from XLA.

:func:`run_plan` takes a composed ``tpu-train`` config and returns one dict: the analytic
estimate (:func:`tpu_train.planner.estimate_from_config`) and, beside it, what XLA says about
the *real* compiled PyTorch step (``compile_train_step``'s program for the Llama plan on the
target mesh), lowered for abstract sharded inputs in a subprocess with as many virtual CPU
devices as the mesh has chips: no parameter is ever allocated (the model is built on the
``meta`` device). If that fails, the hand-written JAX reference step is analysed instead and
``xla_source`` says so. Running the module prints a report whose last line is one JSON object.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import time
from typing import Any

from . import planner

__all__ = ["compiled_step_analysis", "format_plan", "plan_job", "planning_config", "run_plan"]


# Bounds the analysis child so a plan never hangs; a 70B model on 128 virtual devices has
# needed more than 10 minutes on a loaded 2-core machine.
CHILD_TIMEOUT_S = 1800.0
# data.seq_len: null plans the model's maximum positions up to this: the trainer's cap
# (tpu_train.trainer.config.DEFAULT_MAX_SEQ_LEN; this layer may not import the trainer).
DEFAULT_MAX_SEQ_LEN = 2048
# The program is analysed, never run: LLVM's optimizations only cost time (2-3x the compile
# on debug_tiny) and change no figure (buffer assignment happens before them). XLA's CPU
# pipeline also merges every gradient's all-reduce into one at the end of the step, so each
# gradient's unreduced input and output stay live together (3x the parameters per layer on
# Llama-3.1-70B: gathered weights, unreduced gradients and their sums); a TPU reduce-scatters
# each gradient as it is made. Without that merge the CPU program's memory has the TPU's shape.
# Nor are dots handed to the CPU's YNNPACK library, which a TPU does not have: its fusions
# change the CPU program's temporaries (Llama-3.1-70B, fsdp=128, activation checkpointing:
# XLA's figure +14.2 % against the analytic one with them, -9.7 % without).
ANALYSIS_ONLY_XLA_FLAGS = ("--xla_backend_optimization_level=0",
                           "--xla_llvm_disable_expensive_passes=true",
                           "--xla_disable_hlo_passes=cpu-all-reduce-combiner",
                           "--xla_cpu_experimental_ynn_fusion_type=")


def compiled_step_analysis(model_name: str, *, data: int, fsdp: int, tensor: int, batch: int,
                           seq_len: int, overrides: dict | None = None,
                           checkpoint: str | None = None,
                           activation_checkpointing: bool = False,
                           precision: str = "fp32", scan_layers: bool | None = None) -> dict[str, Any]:
    """XLA's memory and cost analysis of the compiled PyTorch Llama step on this process's
    devices (run it where ``len(jax.devices())`` equals the mesh size), with the trainer's
    activation checkpointing and bf16 autocast when asked."""
    import torch
    import torch.nn.functional as F

    from tpu_train.compile import lower_train_step
    from tpu_train.models import Llama

    from .activation_checkpointing import apply_activation_checkpointing
    from .llama_plan import llama_plan
    from .mesh import build_mesh
    from .planner import planned_model

    cfg = dataclasses.replace(planned_model(model_name, checkpoint), **(overrides or {}))
    mesh = build_mesh(data, fsdp, tensor, model_config=cfg)
    # Nothing is allocated: the model, its optimizer state and the batch live on ``meta``.
    with torch.device("meta"):
        model = Llama(cfg)
        batch = {"tokens": torch.empty(batch, seq_len, dtype=torch.int64),
                 "labels": torch.empty(batch, seq_len, dtype=torch.int64)}
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def loss_fn(m, b):
        logits = m(b["tokens"])
        return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())

    program = lower_train_step(model, optimizer, loss_fn, batch, mesh=mesh, plan=llama_plan(),
                               autocast_dtype=torch.bfloat16 if precision == "bf16" else None,
                               scan_layers=scan_layers, runtime_options=False)
    out: dict[str, Any] = {"xla_source": "compiled PyTorch step"}
    out.update(program.analysis())
    out["seconds"] = program.seconds
    return out


def run_plan(cfg: Any, num_devices: int | None = None, *, xla: bool = True,
             timeout_s: float = CHILD_TIMEOUT_S) -> dict[str, Any]:
    """The plan of composed config ``cfg``: analytic figures, XLA's beside them, a verdict.

    Returns the analytic estimate's dict with ``xla`` (XLA's per-device memory and FLOPs of
    the compiled step, or of the JAX reference step with ``xla_source`` saying so, or an
    ``xla_error``) and ``fits_xla`` (XLA's peak within the chip's usable HBM).
    """
    result = dict(planner.estimate_from_config(cfg, num_devices))
    if not xla:
        return result
    mesh = result.get("mesh") or {}
    degrees = {k: int(mesh.get(k, v)) for k, v in
               (("data", cfg.parallel.data), ("fsdp", cfg.parallel.fsdp),
                ("tensor", cfg.parallel.tensor))}
    n = degrees["data"] * degrees["fsdp"] * degrees["tensor"]
    args = dict(model_name=cfg.model.name, checkpoint=cfg.model.checkpoint,
                batch=int(cfg.data.batch_size),
                seq_len=int(cfg.data.seq_len),
                activation_checkpointing=bool(cfg.trainer.activation_checkpointing),
                precision=planner.precision_of(cfg),
                scan_layers=cfg.trainer.scan_layers,
                **degrees)
    cmd = [sys.executable, "-m", "tpu_train.parallel.plan_command", "--child", json.dumps(args)]
    try:
        env = planner.virtual_devices_env(n)
        env["XLA_FLAGS"] += " " + " ".join(ANALYSIS_ONLY_XLA_FLAGS)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        if proc.returncode or not lines:
            raise RuntimeError(proc.stderr[-2000:])
        result["xla"] = json.loads(lines[-1])
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as err:
        note = f"compiled PyTorch step could not be analysed ({str(err)[-300:]})"
        try:
            result["xla"] = planner.xla_analysis_subprocess(
                cfg.model.name, num_devices=n, batch=int(cfg.data.batch_size),
                seq_len=int(cfg.data.seq_len),
                activation_checkpointing=bool(cfg.trainer.activation_checkpointing),
                timeout_s=timeout_s, **degrees)
            result["xla"]["xla_source"] = "JAX reference step; " + note
        except Exception as ref_err:  # report, never crash the planning command
            result["xla"] = {"xla_error": f"{note}; reference step failed too: {ref_err}"}
    peak = result["xla"].get("bytes_peak_estimate")
    if peak is not None:
        # XLA's figure relative to the analytic total: the planner's calibration check.
        result["xla_vs_analytic"] = peak / result["bytes_total"] - 1
        if cfg.plan.chip is not None:
            chip = planner.get_chip(cfg.plan.chip)
            result["fits_xla"] = peak <= chip.hbm_bytes * (1 - planner.HEADROOM)
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
        model_max = int(planner.planned_model(planned.model.name,
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


def format_plan(result: dict[str, Any]) -> str:
    """The analytic report, XLA's figures of the compiled step beside it, and the gap."""
    lines = [planner.format_report({k: v for k, v in result.items() if k != "xla"})]
    x = result.get("xla")
    if x is None:
        return lines[0]
    if "bytes_peak_estimate" not in x:
        lines.append(f"XLA analysis unavailable: {x.get('xla_error', 'no figures')}")
        return "\n".join(lines)
    gib = planner.GiB
    lines.append(
        f"XLA ({x.get('xla_source', 'compiled step')}, {result['num_devices']} virtual CPU "
        f"devices): {x['bytes_peak_estimate'] / gib:.2f} GiB per chip (arguments "
        f"{x['argument_size_in_bytes'] / gib:.2f}, temporaries {x['temp_size_in_bytes'] / gib:.2f}"
        f" GiB), {x['flops_per_device']:.3e} FLOPs per chip")
    lines.append(f"XLA vs analytic per-chip memory: {100 * result['xla_vs_analytic']:+.1f} %"
                 + ("" if "fits_xla" not in result else
                    f"; by XLA's figure the step {'FITS' if result['fits_xla'] else 'DOES NOT FIT'}"))
    return "\n".join(lines)


def plan_job(cfg: Any, *, out=None) -> dict[str, Any]:
    """``tpu-train plan``: plan ``cfg``, print the report and one JSON line, return the dict."""
    out = out if out is not None else sys.stdout
    planned, notes = planning_config(cfg)
    start = time.perf_counter()
    result = run_plan(planned)
    result["plan_seconds"] = time.perf_counter() - start
    result["notes"] = notes
    for note in notes:
        print(f"note: {note}", file=out)
    print(format_plan(result), file=out)
    print(json.dumps(result, default=str), file=out)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--child":
        print(json.dumps(compiled_step_analysis(**json.loads(argv[1]))))
        return 0
    print("usage: python -m tpu_train.parallel.plan_command --child JSON (internal; the "
          "command line is `tpu-train plan`)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
