"""What XLA says about a plan's compiled step: per-chip memory and FLOPs, from one compiler.

:func:`compiled_step_analysis` builds the step the trainer would run for a named model (on
the ``meta`` device: nothing the size of the model is allocated), lowers it over a
``(data, fsdp, tensor)`` mesh for abstract sharded inputs and reads the compiled program's
``memory_analysis()`` and ``cost_analysis()``. Two compilers can produce it:

* **TPU** (``target="v5e:16x16"``): XLA's TPU compiler from libtpu, for the pod's real
  topology (:mod:`tpu_train.compile.targets`; no chip needed, any x86-64 host). Its buffer
  assignment and FLOPs are the TPU's. With ``plan.fast`` (the default) the plan command's child
  reads them from the compiler's dump as soon as its HLO passes end and exits without
  waiting for code generation, most of the compile, which adds to the temporaries
  (:mod:`tpu_train.planning.tpu_dump`).
* **CPU** (``target=None``): this process's devices; for a pod-sized mesh, a child process
  with as many virtual CPU devices (:func:`analyse_in_child`). The CPU compiler's buffers are
  only a stand-in for a TPU's (bf16 elementwise work is kept in f32, for one).

XLA's cost analysis counts a ``while`` loop's body once, whatever its trip count. A step
whose decoder layers are scanned (``trainer.scan_layers``) runs each layer's forward and
backward as a loop body, so its raw FLOPs cover one layer, not ``n_layers``.
:func:`loop_flops` recovers the missing iterations from the optimized program (module
docstring there); the analysis reports both (``flops_per_device`` is the corrected figure,
``flops_per_device_raw`` XLA's).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tpu_train.compile import lower_train_step, memory_errors
from tpu_train.compile.program import compiled_analysis
from tpu_train.compile.stored_moments import AdamWStoredMoments
from tpu_train.compile.targets import TargetError, parse_target, resolve_target
from tpu_train.models import family_of
from tpu_train.parallel.activation_checkpointing import apply_activation_checkpointing
from tpu_train.parallel.family_plans import sharding_plan
from tpu_train.parallel.mesh import build_mesh

from . import compiler_log, tpu_dump
from .estimate import planned_model
from .frozen_base import adapt_meta_model
from .loop_flops import loop_flops
from .step_time import predict_step_time

__all__ = ["ANALYSIS_ONLY_XLA_FLAGS", "CHILD_TIMEOUT_S", "analyse_in_child",
           "compiled_step_analysis", "pod_topology", "virtual_devices_env"]

# Bounds the analysis child so a plan never hangs; a 70B model on 128 virtual CPU devices has
# needed more than 10 minutes on a loaded 2-core machine.
CHILD_TIMEOUT_S = 1800.0
# The CPU program is analysed, never run: LLVM's optimizations only cost time (2-3x the
# compile on debug_tiny) and change no figure (buffer assignment happens before them). XLA's
# CPU pipeline also merges every gradient's all-reduce into one at the end of the step, so
# each gradient's unreduced input and output stay live together (3x the parameters per layer
# on Llama-3.1-70B: gathered weights, unreduced gradients and their sums); a TPU
# reduce-scatters each gradient as it is made. Without that merge the CPU program's memory has
# the TPU's shape. Nor are dots handed to the CPU's YNNPACK library, which a TPU does not
# have: its fusions change the CPU program's temporaries (Llama-3.1-70B, fsdp=128, activation
# checkpointing: XLA's figure +14.2 % against the analytic one with them, -9.7 % without).
ANALYSIS_ONLY_XLA_FLAGS = ("--xla_backend_optimization_level=0",
                           "--xla_llvm_disable_expensive_passes=true",
                           "--xla_disable_hlo_passes=cpu-all-reduce-combiner",
                           "--xla_cpu_experimental_ynn_fusion_type=")
# How long an out-of-memory compile waits for the watcher to read the compiler's dump.
_DUMP_WAIT_S = 300.0
_EXIT_BAD_TARGET = 3  # the analysis child's exit status for a TargetError
# The child's entry (not ``-m``: the package imports this module first, and runpy warns).
_CHILD_MAIN = "import sys; from tpu_train.planning.analysis import main; sys.exit(main())"
# libtpu on a host without chips: no metadata server to ask, a single host, and other
# processes (a test run, the parent) may have loaded libtpu too.
CHIPLESS_LIBTPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
                       "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def pod_topology(chip: str, num_chips: int) -> str:
    """The TPU target name (``"v5e:16x16"``) of ``num_chips`` chips of generation ``chip``.

    ``chip`` may name the topology itself (``"v5p:4x4x8"``), which must hold ``num_chips``;
    otherwise the slice is the most nearly cubic (square for 2-D generations) one, smallest
    axes first and axes of one chip last, as TPU slices are named: 256 v5e chips are 16x16,
    128 v5p chips 4x4x8, 4 v5p chips 2x2x1. Checked without libtpu (a bad name is a
    :class:`TargetError`).
    """
    generation, shape = parse_target(chip)
    if ":" in chip:
        if math.prod(shape) != num_chips:
            raise TargetError(f"plan.chip={chip!r} has {math.prod(shape)} chips but the mesh "
                              f"(parallel.data * fsdp * tensor) has {num_chips}")
        return f"{generation}:{'x'.join(map(str, shape))}"
    dims, remaining = [], num_chips
    for left in range(len(shape), 0, -1):  # each axis takes about the left-th root of the rest
        size = max(d for d in range(1, remaining + 1)
                   if remaining % d == 0 and d ** left <= remaining)
        dims.append(size)
        remaining //= size
    dims[-1] *= remaining
    dims = [d for d in dims if d > 1] + [d for d in dims if d == 1]  # 4 v5p chips: 2x2x1
    return f"{generation}:{'x'.join(map(str, dims))}"


def _build_step(cfg, *, batch: int, seq_len: int, remat: str,
                param_dtype: torch.dtype | None = None, state_dtype: torch.dtype | None = None,
                lora: dict | None = None, compute_dtype: torch.dtype | None = None):
    """``(model, optimizer, loss_fn, batch)`` on ``meta``, as the trainer builds them
    (``trainer.param_dtype``, ``optim.state_dtype``: None for the defaults; ``lora``: a LoRA
    run's adapters and int8 base, :func:`.frozen_base.adapt_meta_model`)."""
    family = family_of(cfg)
    with torch.device("meta"):
        model = family.build(cfg)
        tokens = {"tokens": torch.empty(batch, seq_len, dtype=torch.int64),
                  "labels": torch.empty(batch, seq_len, dtype=torch.int64)}
        adapt_meta_model(model, lora, compute_dtype)
    if param_dtype is not None:
        model.to(param_dtype)
    apply_activation_checkpointing(model, remat, blocks=family.blocks(model),
                                   qkv_projections=family.qkv_projections)
    trained = [p for p in model.parameters() if p.requires_grad]
    if state_dtype is None:
        optimizer = torch.optim.AdamW(trained, lr=1e-4, weight_decay=0.1)
    else:
        optimizer = AdamWStoredMoments(trained, lr=1e-4, weight_decay=0.1,
                                       state_dtype=state_dtype)

    def loss_fn(m, b):
        # position_ids: added by a context-parallel step (tpu_train.compile.context_parallel)
        extra = {"position_ids": b["position_ids"]} if "position_ids" in b else {}
        logits = m(b["tokens"], **extra)
        return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())

    return model, optimizer, loss_fn, tokens


def compiled_step_analysis(model_name: str, *, data: int, fsdp: int, tensor: int, batch: int,
                           expert: int = 1,
                           seq_len: int, context: int = 1, overrides: dict | None = None,
                           checkpoint: str | None = None,
                           activation_checkpointing: bool = False, remat: str | None = None,
                           compute_dtype: torch.dtype | None = None,
                           param_dtype: torch.dtype | None = None,
                           state_dtype: torch.dtype | None = None,
                           lora: dict | None = None,
                           scan_layers: bool | None = None, grad_accum_steps: int = 1,
                           target: str | None = None, num_slices: int = 1,
                           dcn_fsdp: int = 1,
                           dump_to: str | None = None,
                           on_dumped: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """XLA's memory and cost analysis of the compiled PyTorch step of a named model config.

    ``remat`` (``trainer.remat``; ``activation_checkpointing``: ``full``). ``batch``: the
    step's rows, run ``batch / grad_accum_steps`` at a time (the trainer's split of a step).
    A step that does not fit in the target's memory is not an error: the figures are what
    XLA's out-of-memory compile says (``out_of_memory``: its message).
    ``target`` (``"v5e:2x2"``): compiled by XLA's TPU compiler for that topology, which must
    hold ``data * fsdp * tensor`` chips. None: for this process's devices (run it where
    ``len(jax.devices())`` equals the mesh size). ``num_slices`` (TPU targets): that many
    slices of ``target`` joined by DCN, the mesh's ``data`` degree split across them (``dcn_fsdp``
    of the slices' ways on ``fsdp`` instead); each slice holds ``data * fsdp * tensor /
    num_slices`` chips, so ``target`` names one slice. The trainer's activation checkpointing and
    ``compute_dtype`` (the trainer's: bf16 for ``trainer.precision=bf16``) apply when asked, and
    so do ``param_dtype`` and ``state_dtype`` (``trainer.param_dtype``, ``optim.state_dtype``)
    and ``lora`` (a LoRA run's adapters and int8 base: :mod:`.frozen_base`). ``dump_to`` (a directory): the compiler dumps its
    optimized HLO and buffer assignment there; with ``on_dumped`` (TPU targets, in a process
    that only plans) the figures are read from that dump as soon as it is written, passed to
    ``on_dumped``, and the process ends without waiting for code generation
    (:mod:`tpu_train.planning.tpu_dump`).
    """
    cfg = dataclasses.replace(planned_model(model_name, checkpoint), **(overrides or {}))
    devices = resolve_target(target, num_slices).devices if target is not None else None
    family = family_of(cfg)
    mesh = build_mesh(data, fsdp, tensor, devices=devices, split_sizes=family.split_sizes(cfg),
                      dcn_fsdp=dcn_fsdp, expert=expert, context=context)
    device_slices = [getattr(d, "slice_index", 0) for d in mesh.devices.flat]
    model, optimizer, loss_fn, tokens = _build_step(
        cfg, batch=batch, seq_len=seq_len,
        remat=remat or ("full" if activation_checkpointing else "none"),
        param_dtype=param_dtype, state_dtype=state_dtype, lora=lora,
        compute_dtype=compute_dtype)
    program = lower_train_step(model, optimizer, loss_fn, tokens, mesh=mesh,
                               plan=sharding_plan(family), compute_dtype=compute_dtype,
                               grad_accum_steps=grad_accum_steps, scan_layers=scan_layers,
                               runtime_options=False, compile=False)
    out: dict[str, Any] = {"xla_source": "compiled PyTorch step",
                           "compiler": "TPU" if target is not None else "CPU"}
    if target is not None:
        out["compiled_for"] = resolve_target(target).name + (
            f" x {num_slices} slices" if num_slices > 1 else "")
    seconds = {stage: s for stage, s in program.seconds.items() if stage != "compile"}
    started = time.perf_counter()
    watcher = None
    if on_dumped is not None:
        def report(figures: dict, text: str) -> None:
            seconds["compile_until_buffer_assignment"] = time.perf_counter() - started
            on_dumped({**out, **figures, **loop_flops(text, figures["flops_per_device"]),
                       **_step_time(text, target, device_slices), "seconds": seconds})

        watcher = tpu_dump.report_when_dumped(dump_to, report)
    try:
        compiled = program.lowered.compile(
            compiler_options=tpu_dump.dump_options(dump_to) if dump_to else None)
    except Exception as error:  # noqa: BLE001 - only XLA's RESOURCE_EXHAUSTED is a figure
        found = memory_errors.out_of_memory(
            error, memory_errors.argument_bytes(program.lowered, program.in_shardings))
        if found is None:
            raise
        if watcher is not None:
            # The compiler dumped its buffer assignment before it gave up: the watcher
            # reports that (FLOPs included) and ends this process.
            watcher.join(_DUMP_WAIT_S)
        seconds["compile"] = time.perf_counter() - started
        return {**out, **_out_of_memory_figures(found), "seconds": seconds}
    seconds["compile"] = time.perf_counter() - started
    out.update(compiled_analysis(compiled))
    text = compiled.as_text()
    out.update(loop_flops(text, out["flops_per_device"]))
    if target is not None:
        out.update(_step_time(text, target, device_slices))
    out["seconds"] = seconds
    return out


def _step_time(text: str, target: str, device_slices: list[int]) -> dict[str, Any]:
    """``{"step_time": ...}``: the step's time predicted from its TPU program
    (:mod:`tpu_train.planning.step_time`; ``device_slices``: each mesh device's slice), or
    ``step_time_error`` saying why there is none."""
    try:
        return {"step_time": predict_step_time(text, parse_target(target)[0],
                                               device_slices=device_slices)}
    except (ValueError, KeyError) as error:  # a program this model cannot read: said, not fatal
        return {"step_time_error": f"{type(error).__name__}: {error}"}


def _out_of_memory_figures(error: memory_errors.ProgramOutOfMemoryError) -> dict[str, Any]:
    """What XLA's out-of-memory compile says: the bytes the step needs per chip (temporaries
    and arguments) and the chip's, as the memory figures of a program that does not fit."""
    figures: dict[str, Any] = {"out_of_memory": error.detail,
                               "compiler_capacity_bytes": error.capacity_bytes}
    if error.needed_bytes is not None:
        figures.update(bytes_peak_estimate=error.needed_bytes,
                       argument_size_in_bytes=error.argument_bytes,
                       temp_size_in_bytes=error.needed_bytes - error.argument_bytes)
    return figures


def virtual_devices_env(num_devices: int) -> dict:
    """This process's environment for a child JAX with ``num_devices`` virtual CPU devices
    and the CPU analysis flags."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={num_devices}",
                                         *ANALYSIS_ONLY_XLA_FLAGS])
    env["JAX_PLATFORMS"] = "cpu"
    env["TPU_TRAIN_PLATFORM"] = "cpu"
    return env


def _tpu_compiler_env() -> dict:
    """A child that runs nothing (its JAX platform is the CPU: chips on this host, if any,
    stay free) and compiles with libtpu's TPU compiler."""
    env = dict(os.environ)
    for key, value in CHIPLESS_LIBTPU_ENV.items():
        env.setdefault(key, value)
    env["JAX_PLATFORMS"] = "cpu"
    env["TPU_TRAIN_PLATFORM"] = "cpu"
    return env


def analyse_in_child(args: dict[str, Any], *, num_devices: int,
                     timeout_s: float = CHILD_TIMEOUT_S,
                     until_buffer_assignment: bool = True) -> dict[str, Any]:
    """:func:`compiled_step_analysis` of ``args`` in a fresh interpreter: with libtpu's TPU
    compiler when ``args["target"]`` names a topology, else on ``num_devices`` virtual CPU
    devices (their count is fixed when JAX starts). ``until_buffer_assignment`` (TPU only):
    the child reports the figures of the compiler's buffer assignment and exits before code
    generation. Raises :class:`TargetError` for a topology libtpu rejects, RuntimeError with
    the child's error output for other failures."""
    on_tpu = args.get("target") is not None
    env = _tpu_compiler_env() if on_tpu else virtual_devices_env(num_devices)
    early = on_tpu and until_buffer_assignment
    with tempfile.TemporaryDirectory(prefix="tpu-train-plan-") as work:
        child_args = {**args, "dump_to": work} if early else args
        if on_tpu and not early:  # the compiler's own total comes at the end of its log
            env = compiler_log.log_env(work, env)
        cmd = [sys.executable, "-c", _CHILD_MAIN, "--child",
               json.dumps(child_args, default=_dtype_name)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        total = compiler_log.total_hbm_bytes(work) if on_tpu and not early else None
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode == _EXIT_BAD_TARGET:  # libtpu rejected the topology: bad input
        raise TargetError(proc.stderr.strip().splitlines()[-1])
    if proc.returncode or not lines:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
    figures = json.loads(lines[-1])
    if total is not None:
        figures["compiler_total_hbm_bytes"] = total["total"]
        figures["compiler_reserved_hbm_bytes"] = total["reserved"]
    return figures


def _dtype_name(value: Any) -> str:
    """A torch dtype as JSON carries it to the child (``compute_dtype``: ``"bfloat16"``)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    raise TypeError(f"{type(value).__name__} {value!r} cannot be passed to the analysis child")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--child":
        args = json.loads(argv[1])
        for key in ("compute_dtype", "param_dtype", "state_dtype"):
            if isinstance(args.get(key), str):  # the name _dtype_name gave it
                args[key] = getattr(torch, args[key])
        if args.get("dump_to"):
            args["on_dumped"] = lambda figures: print(json.dumps(figures), flush=True)
        try:
            print(json.dumps(compiled_step_analysis(**args)))
        except TargetError as error:
            print(error, file=sys.stderr)
            return _EXIT_BAD_TARGET
        return 0
    print("usage: --child JSON (the plan command's analysis child; the command line is "
          "`tpu-train plan`)", file=sys.stderr)
    return 2
