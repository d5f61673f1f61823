"""One training run as one object: what :func:`assemble` builds, :func:`resume` restores and
:func:`~tpu_train.trainer.loop.fit` trains.

    job = start(cfg)            # checks, processes, seed, device
    run = assemble(job)         # tokenizer, data, model, layout, optimizer, schedule, step
    resume(run)                 # run.dir's newest checkpoint, if any
    fit(run)                    # train, validate, checkpoint, export

:func:`assemble` calls the blocks of :mod:`tpu_train.trainer.setup` in order; a recipe that
needs a different part builds the :class:`Run` itself from the same blocks. Nothing here
writes to the run directory: a bad configuration fails before the run starts (the logger is
opened by ``fit``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from .checkpoint import (CheckpointManager, checkpoint_dirs, checkpoint_layout,
                         latest_intact_checkpoint, read_checkpoint, verify_checkpoint)
from .errors import ConfigError
from .layouts import Layout
from .rng import restore_rng_state
from .schedules import continue_schedule
from .setup import (Data, Job, build_data, build_model, build_optimizer, build_scheduler,
                    build_tokenizer, describe_source, parallelize)
from .step import TrainStep

ModelChange = Callable[[torch.nn.Module], torch.nn.Module]


@dataclasses.dataclass
class Run:
    """Everything one training run uses; ``step`` is the number of steps the model has
    taken (0, or the resumed checkpoint's, then advanced by the loop)."""

    job: Job
    tokenizer: Any
    data: Data
    model: torch.nn.Module
    layout: Layout
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step_fn: TrainStep
    checkpointer: CheckpointManager
    # What the model's starting weights are, for the run's summary.
    source: str
    # Applied to every model of the architecture built for this run (e.g. LoRA adapters).
    adapt: ModelChange | None = None
    # The model to export from the trained one (e.g. LoRA merged); default the model itself.
    export: ModelChange | None = None
    step: int = 0
    resumed_from: Path | None = None
    logger: Any = None  # the RunLogger, opened by ``fit``

    def fresh_model(self) -> torch.nn.Module:
        """A new CPU model of the same architecture (validation runs on such a host copy)."""
        return build_model(self.job, self.tokenizer, from_checkpoint=False, adapt=self.adapt)

    def model_to_export(self) -> torch.nn.Module:
        return self.export(self.model) if self.export else self.model


def assemble(job: Job, bundled: str = "tasks", adapt: ModelChange | None = None,
             export: ModelChange | None = None) -> Run:
    """The run the configuration describes, ready to :func:`resume` and train.

    ``bundled``: the bundled corpus file trained on when ``data.path`` is null (``"tasks"``,
    or ``"prose"`` for pretraining). ``adapt`` changes each model built (before its layout is
    applied), ``export`` gives the model to export from the trained one.
    """
    cfg = job.cfg
    tokenizer = build_tokenizer(cfg)
    data = build_data(job, tokenizer, bundled)
    # On the CPU, from model.checkpoint when set, adapted; with model.base_dtype=int8 its
    # frozen linear weights quantized as they are read.
    model = build_model(job, tokenizer, adapt=adapt)
    layout = parallelize(job, model)
    optimizer = build_optimizer(model, cfg)  # the trainable parameters only
    scheduler = build_scheduler(optimizer, cfg)
    step_fn = layout.build_step(job, model, optimizer, scheduler)
    checkpointer = CheckpointManager(job.run_dir, cfg.checkpoint.keep_last,
                                     cfg.checkpoint.async_save, is_writer=job.world.is_main)
    return Run(job, tokenizer, data, model, layout, optimizer, scheduler, step_fn, checkpointer,
               describe_source(cfg), adapt=adapt, export=export)


def checkpoint_to_resume(job: Job) -> Path | None:
    """The newest intact checkpoint of ``run.dir``, or ``checkpoint.load_step``'s; None to start.

    Every candidate is verified against the SHA-256 sums in its ``meta.json``
    (:func:`~tpu_train.trainer.checkpoint.verify_checkpoint`; checkpoints written before the
    sums existed load unverified). A damaged newest checkpoint is never used: a warning names
    it, what is wrong and the older intact one resumed instead (recorded in ``job.notes`` for
    ``train.log`` too). A damaged ``checkpoint.load_step``, or no intact checkpoint at all, is
    a :class:`ConfigError`.
    """
    options = job.cfg.checkpoint
    found = dict(checkpoint_dirs(job.run_dir))
    if found and not options.resume:
        raise ConfigError(
            f"run.dir={str(job.run_dir)!r} holds checkpoints (newest {found[max(found)].name}) "
            "and checkpoint.resume=false; choose a new run.dir to start fresh")
    if options.load_step is not None:
        if options.load_step not in found:
            raise ConfigError(
                f"checkpoint.load_step={options.load_step}: run.dir={str(job.run_dir)!r} has no "
                f"checkpoint of that step; it has steps {sorted(found) or 'none'}")
        chosen = found[options.load_step]
        problem = verify_checkpoint(chosen)
        if problem is not None:
            raise ConfigError(f"checkpoint.load_step={options.load_step}: {chosen} is damaged "
                              f"({problem}); choose another step or delete it")
        return chosen
    if not found:
        return None
    chosen, damaged = latest_intact_checkpoint(job.run_dir)
    if chosen is None:
        raise ConfigError(
            f"run.dir={str(job.run_dir)!r}: every checkpoint is damaged (newest "
            f"{damaged[0][0].name}: {damaged[0][1]}); choose a new run.dir to start fresh")
    for path, problem in damaged:
        note = (f"warning: checkpoint {path} is damaged ({problem}); resuming from the newest "
                f"intact one, {chosen}")
        job.notes.append(note)
        if job.world.is_main:
            print(f"tpu-train: {note}", file=sys.stderr, flush=True)
    return chosen


def resume(run: Run) -> Run:
    """Load the newest checkpoint of ``run.dir`` into ``run`` if there is one, and place the
    step; ``run.step`` and ``run.resumed_from`` say where it continues from. Every layout
    restores onto any mesh and process count."""
    job = run.job
    found = checkpoint_to_resume(job)
    if found is None:
        run.step_fn.place()
        return run
    try:
        model_state, training_state, meta = read_checkpoint(found)
    except Exception as exc:  # noqa: BLE001 - an unverified (older) checkpoint that is damaged
        raise ConfigError(f"cannot read checkpoint {found} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); choose "
                          "another checkpoint.load_step or a new run.dir") from exc
    if model_state is None and run.step_fn.compiled is None:
        raise ConfigError(
            f"{found} is a sharded checkpoint (written by several processes sharing one mesh); "
            "it resumes with the compiled step, on any mesh or one device: set "
            "trainer.mode=compiled trainer.device=tpu")
    try:
        run.layout.load(run, found, model_state, training_state)
        run.scheduler.load_state_dict(training_state["scheduler"])
        run.data.train.load_state_dict(training_state["data"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"run.dir={str(job.run_dir)!r} holds a checkpoint of a different configuration "
            f"({checkpoint_layout(found)} layout: {str(exc).splitlines()[0]}); use a new "
            "run.dir or the original settings") from exc
    restore_rng_state(training_state["rng"], job.device)
    _note_kept_settings(job, training_state)
    note = continue_schedule(run.scheduler, job.cfg.scheduler, job.cfg.trainer.max_steps,
                             int(meta["step"]))
    if note:
        job.notes.append(note)
    run.step, run.resumed_from = int(meta["step"]), found
    return run


def _note_kept_settings(job: Job, training_state: dict) -> None:
    """A resumed run continues the checkpoint's schedule and optimizer settings exactly (that
    is what makes resuming exact); a different ``optim.lr`` on the command line is therefore
    not applied, and the run says so instead of ignoring it silently."""
    saved = training_state["scheduler"].get("base_lrs") or []
    wanted = float(job.cfg.optim.lr)
    if saved and any(abs(lr - wanted) > 1e-12 * max(abs(lr), abs(wanted)) for lr in saved):
        job.notes.append(
            f"note: optim.lr={wanted:g} differs from the resumed checkpoint's {saved[0]:g}; the "
            "checkpoint's optimizer and schedule settings are kept (resume in a new run.dir "
            "from its hf/ export to change them)")
