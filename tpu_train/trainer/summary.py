"""What a run says about itself: the opening block, compile events and the closing block."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .layouts import Layout


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)}"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable), each parameter counted once at its global size."""
    seen, total, trainable = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


def _model_label(cfg, model: torch.nn.Module) -> str:
    """The preset's name, or the shape of a model built from a checkpoint's own config."""
    config = getattr(model, "config", None)
    if cfg.model.checkpoint is None or config is None:
        return cfg.model.name
    return (f"{type(model).__name__} dim {config.dim}, {config.n_layers} layers, "
            f"{config.n_heads}/{config.n_kv_heads} heads, vocab {config.vocab_size}")


def _device_line(job, parallel: Layout) -> str:
    text = f"{job.device.type}"
    if job.device.type == "tpu":
        from tpu_train.device.runtime import platform

        text += f" ({platform()} platform)"
    return f"{text} | {parallel.describe()}"


def _precision_line(job) -> str:
    from .config import BaseDtype, ParamDtype, Precision, StateDtype, StepMode

    if job.precision is not Precision.bf16:
        compute = "fp32"
    elif job.mode is StepMode.compiled:
        compute = "bf16 compute (bf16 copies of the parameters: activations in bf16, " \
                  "norm statistics, softmax and loss in fp32)"
    else:
        compute = "bf16 autocast (matmuls in bf16, reductions in fp32)"
    weights = ParamDtype(job.cfg.trainer.param_dtype).value
    moments = StateDtype(job.cfg.optim.get("state_dtype", "param"))
    base = ("; frozen linear weights in int8 (per-channel scales)"
            if BaseDtype(job.cfg.model.get("base_dtype", "param")) is BaseDtype.int8 else "")
    if moments is StateDtype.param:
        return f"{compute}; weights and optimizer state stored in {weights}{base}"
    return (f"{compute}; weights stored in {weights}, Adam moments in {moments.value} "
            f"(updated in fp32){base}")


def start_summary(run, state_bytes: int) -> list[str]:
    """The lines printed before ``run``'s first step (``state_bytes``: parameters and optimizer
    state on the busiest device)."""
    job, parallel, model, optimizer = run.job, run.layout, run.model, run.optimizer
    source, resumed_from = run.source, run.resumed_from
    cfg = job.cfg
    total, trainable = _parameter_counts(model)
    batch, seq, accum = cfg.data.batch_size, cfg.data.seq_len, cfg.trainer.grad_accum_steps
    per_step = batch * seq * accum
    rows_here = parallel.rows_per_shard(batch)
    budget = per_step * cfg.trainer.max_steps
    resumed = f" (resumed from {resumed_from.name})" if resumed_from is not None else ""
    memory = f"{_bytes(state_bytes)} of parameters + optimizer state on the busiest device"
    if not any(optimizer.state.values()):
        memory = (f"{_bytes(state_bytes)} of parameters on the busiest device (the optimizer "
                  "state is allocated at the first step)")
    from .schedules import effective_warmup

    warmup = effective_warmup(cfg.scheduler, cfg.trainer.max_steps)
    notes = []
    if warmup != cfg.scheduler.warmup_steps:
        notes.append(f"note: scheduler.warmup_steps={cfg.scheduler.warmup_steps} is longer than "
                     f"the {cfg.trainer.max_steps}-step run; warming up over {warmup} step(s)")
    return notes + [
        f"run dir: {job.run_dir}{resumed}",
        f"model: {_model_label(cfg, model)}, {_count(total)} parameters ({_count(trainable)} "
        f"trainable), from {source}",
        f"data: global batch {batch} x {seq} tokens x {accum} accumulation = {per_step:,} "
        f"tokens/step ({rows_here} row{'s' if rows_here != 1 else ''} per data-parallel shard"
        f"{_micro_note(cfg.trainer.micro_batch_size, rows_here)}); budget "
        f"{cfg.trainer.max_steps} steps = {budget:,} tokens",
        f"device: {_device_line(job, parallel)}",
        f"precision: {_precision_line(job)}; step: {job.mode.value}",
        f"memory: {memory}",
    ]


def _micro_note(micro: int | None, rows: int) -> str:
    """``, 2 at a time`` where ``trainer.micro_batch_size`` splits a shard's rows."""
    return "" if micro is None or micro >= rows else f", {micro} at a time"


def describe_compilation(record) -> str:
    """``compiled the train step in 9.8 s (trace 2.1, lower 0.9, XLA 6.8): first call``, or
    ``loaded the train step from the compilation cache in 1.9 s (trace 1.2, lower 0.6, XLA
    load 0.1): first call`` when XLA's executable came from the persistent cache; with
    ``; 32 layers scanned`` when layer stacks run as ``lax.scan`` loops (``scan_layers``), and
    ``; PyTorch's backward traced (...)`` when the model's use of autograd kept JAX from
    differentiating the forward (a slower trace; ``tpu_train.compile.loss_graph``), and
    ``; compiled ahead, the first step waited 0.4 s for it`` when XLA compiled it while the
    loop did other work (``CompiledTrainStep.compile_ahead``)."""
    times = f"(trace {record.trace_s:.1f}, lower {record.lower_s:.1f}"
    scanned = getattr(record, "scanned_layers", 0)
    cause = record.cause + (f"; {scanned} layers scanned" if scanned else "")
    fallback = getattr(record, "autodiff_fallback", "")
    if fallback:
        cause += f"; PyTorch's backward traced ({fallback[:120]})"
    waited = getattr(record, "waited_s", None)
    if waited is not None:  # XLA compiled while the starting model was validated
        cause += f"; compiled ahead, the first step waited {waited:.1f} s for it"
    loaded_from = getattr(record, "loaded_from", None)
    if loaded_from is not None:
        return (f"loaded the train step from {loaded_from} in {record.total_s:.1f} s {times}, "
                f"executable load {record.load_s:.1f}, XLA compile {record.compile_s:.1f}): {cause}")
    if getattr(record, "from_cache", False):
        return (f"loaded the train step from the compilation cache in {record.total_s:.1f} s "
                f"{times}, XLA load {record.compile_s:.1f}): {cause}")
    return (f"compiled the train step in {record.total_s:.1f} s {times}, "
            f"XLA {record.compile_s:.1f}): {cause}")


def startup_seconds(records) -> dict[str, float]:
    """Where the train step's start-up went, summed over its compilations (``records``:
    ``CompileRecord``s): ``startup/*`` in TensorBoard and metrics.jsonl. XLA's compile and the
    persistent cache's read are the same stage, told apart by ``from_cache``; an executable
    loaded from ``compile.executable`` stands in for both."""
    values = {"trace_s": 0.0, "lower_s": 0.0, "xla_compile_s": 0.0, "cache_read_s": 0.0,
              "executable_load_s": 0.0}
    for record in records:
        values["trace_s"] += record.trace_s
        values["lower_s"] += record.lower_s
        values["cache_read_s" if record.from_cache else "xla_compile_s"] += record.compile_s
        values["executable_load_s"] += record.load_s
    values["programs"] = float(len(records))
    return values


def describe_startup(records) -> list[tuple[str, str]]:
    """The closing block's row for :func:`startup_seconds` (none without a compiled step)."""
    if not records:
        return []
    values = startup_seconds(records)
    total = sum(v for k, v in values.items() if k.endswith("_s"))
    programs = len(records)
    return [("train step start-up",
             f"{total:.1f} s for {programs} program{'s' if programs != 1 else ''}: trace "
             f"{values['trace_s']:.1f} s, lower {values['lower_s']:.1f} s, XLA compile "
             f"{values['xla_compile_s']:.1f} s, cache read {values['cache_read_s']:.1f} s, "
             f"executable load {values['executable_load_s']:.1f} s")]


def duration(seconds: float) -> str:
    """``42.0 s``, ``3 min 32 s``, ``2 h 05 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _validation_figures(validation: dict, start: dict) -> str:
    """``exact match 84.0% -> 94.0% on 200 held-out examples, loss 0.1400 -> 0.0500``: the
    final figures, each after the starting model's (step 0) where that was validated."""
    values, before = validation["values"], (start or {}).get("values") or {}

    def pair(key: str, fmt: str) -> str:
        now = format(values[key], fmt)
        return f"{format(before[key], fmt)} -> {now}" if key in before else now

    figures = []
    if "exact_match" in values:
        figures.append(f"exact match {pair('exact_match', '.1%')} on "
                       f"{validation['examples']} held-out examples")
    if "loss" in values:
        figures.append(f"loss {pair('loss', '.4f')}")
    if before:
        figures.append("first figure: the starting model, before step 1")
    return ", ".join(figures)


def final_summary(run, export_dir: Path | None, validation: dict,
                  start: dict | None = None,
                  throughput: list[tuple[str, str]] | None = None) -> str:
    """The closing block of ``run``: where everything is, the final validation figures beside
    the starting model's (``start``, step 0), the steady step time and throughput rows
    (``throughput``) and the job's wall time."""
    from .checkpoint import latest_checkpoint

    run_dir, logger, step, source = run.job.run_dir, run.logger, run.step, run.source
    max_steps, checkpoint = run.job.cfg.trainer.max_steps, latest_checkpoint(run_dir)
    wall_s = time.monotonic() - run.job.started
    rows = [("run dir", str(run_dir)), ("started from", source),
            ("train log", str(run_dir / "train.log")),
            ("tensorboard", f"{logger.tensorboard_dir} (tensorboard --logdir {logger.tensorboard_dir})"
             if logger.local_tensorboard_dir.is_dir() else "off (logging.tensorboard=false)"),
            ("checkpoint", str(checkpoint) if checkpoint else "none"),
            ("hf export", str(export_dir) if export_dir else "none")]
    if validation.get("step") == step and validation.get("values"):
        rows.append((f"validation at step {step}", _validation_figures(validation, start)))
    saves = run.checkpointer.times.describe()
    if saves:
        rows.append(("checkpoint saves", saves))
    rows += throughput or []
    rows.append(("wall time", duration(wall_s)))
    width = max(len(key) for key, _ in rows)
    lines = [f"finished step {step}/{max_steps}" if step >= max_steps
             else f"stopped at step {step}/{max_steps}"]
    lines += [f"  {key + ':':<{width + 1}} {value}" for key, value in rows]
    return "\n".join(lines)
