"""``fit``, the training loop every training recipe ends with.

It steps until ``trainer.max_steps``, logs (process 0 only), validates, saves checkpoints
(sharded when several processes share one mesh), stops cleanly on SIGINT/SIGTERM, and at the
end exports the model in Hugging Face format.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from . import builders, saved_step
from .checkpoint import last_good_checkpoint, latest_checkpoint, supersede_later
from .config import OnNonFinite
from .errors import ConfigError, TrainingStopped
from .evaluation import (Decoding, ExactMatchSet, HostEvaluationModel,
                         compile_ahead_for_validation, compiled_decoder, decodes_compiled,
                         compiled_loss, compiled_validation_loss, describe_decoder,
                         exact_match_count, padded_rows, runs_on_host_cpu, validation_loss)
from .metrics import RunLogger, detect_device_kind, format_log_line, peak_bf16_tflops
from .layouts import Layout
from .parallelism import peak_bytes_per_device
from .rng import capture_rng_state
from .run_dirs import SAVED_CONFIG_FILE, resume_command
from .run import Run
from .setup import Job
from .storage_urls import is_local, staged_directory
from .steady import SteadyRate
from .step import BatchesAhead
from .summary import (describe_compilation, describe_startup, final_summary, start_summary,
                      startup_seconds)


class _StopRequest:
    """Turns SIGINT/SIGTERM, and the end of ``trainer.max_minutes`` of training, into a flag
    the loop checks between steps."""

    def __init__(self, max_minutes: float | None = None):
        self._signal_name: str | None = None
        self._previous = {}
        self._max_minutes = max_minutes
        self._deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes

    @property
    def signal_name(self) -> str | None:
        if (self._signal_name is None and self._deadline is not None
                and time.monotonic() >= self._deadline):
            self._signal_name = f"trainer.max_minutes={self._max_minutes:g}"
        return self._signal_name

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self._signal_name = signal.Signals(signum).name

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _ProfileWindow:
    """Traces steps ``first..last`` of ``logging.profile_steps`` (host and device) into the
    TensorBoard directory: ``tensorboard --logdir <run.dir>/tensorboard``, Profile tab."""

    def __init__(self, steps, logger: RunLogger):
        self.steps = tuple(steps) if steps else None
        self.logger = logger
        self._active = None

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0] and self.logger.enabled:
            from tpu_train.compile.profiling import profile

            self._active = profile(str(self.logger.local_tensorboard_dir))
            self._active.__enter__()

    def after(self, step: int) -> None:
        if self._active is not None and step == self.steps[1]:
            self._stop()
            self.logger.line(f"profiled steps {self.steps[0]}-{self.steps[1]}: "
                             f"tensorboard --logdir {self.logger.tensorboard_dir} (Profile tab)")

    def _stop(self) -> None:
        active, self._active = self._active, None
        active.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        if self._active is not None:  # the run ended inside the window
            self._stop()


class _Validator:
    """Validation loss and exact match of the model being trained.

    Exact match decodes with a compiled program on the model's own ``tpu`` device when its
    weights are whole there or replicated (one program per shape bucket, weights as inputs:
    compiled once per run). Otherwise, and for the validation loss where the device is the
    CPU client or the model is spread over a mesh, a host copy runs op by op."""

    def __init__(self, run: Run):
        job, self.parallel, self.model = run.job, run.layout, run.model
        self.job, self.tokenizer, self.data, self.logger = job, run.tokenizer, run.data, run.logger
        on_host = runs_on_host_cpu(job.device) or self.parallel.sharded
        self.host = HostEvaluationModel(run.fresh_model) if on_host else None
        on_device = decodes_compiled(job.device) and self.parallel.decodes_on_device()
        self.decoder = compiled_decoder(self.model, job.precision) if on_device else None
        # Op by op, a validation pass on a TPU compiles each new op on first use.
        self.evaluator = (compiled_loss(self.model, job.precision,
                                        job.cfg.trainer.micro_batch_size)
                          if on_device else None)
        self.last: dict = {}
        self.first: dict = {}  # the starting model's figures (step 0)

    def enabled(self) -> bool:
        return self.data.has_val_loss or self.data.exact_match_path is not None

    def __call__(self, step: int) -> None:
        cfg = self.job.cfg
        values = {}
        model, device = self.model, self.job.device
        if self.host is not None and (self.data.has_val_loss or self.decoder is None):
            model = self.host.refresh(self.parallel.full_model_state(self.model))
            device = torch.device("cpu")
        if self.data.has_val_loss:
            # A fresh pass over the validation file each time (a loader is one stream).
            loader = builders.build_val_loader(cfg, self.tokenizer, self.data.val_path, probe=False)
            if self.evaluator is not None and model is self.model:
                values.update(compiled_validation_loss(self.evaluator, loader,
                                                       cfg.trainer.val_batches))
            else:
                values.update(validation_loss(model, loader, device, cfg.trainer.val_batches,
                                              self.job.precision))
        scored = None
        if self.data.exact_match_path is not None:
            if self.decoder is not None:
                model, device = self.model, self.job.device
                programs = len(self.decoder.compilations)
            decoding = Decoding(device, self.job.precision, cfg.recipe.eval.max_new_tokens,
                                self.decoder)
            scored = exact_match_count(model, self.tokenizer, self.data.exact_match_path,
                                       cfg.recipe.eval.exact_match_examples, decoding)
            if scored is not None:
                values["exact_match"] = scored[0]
            if self.decoder is not None and len(self.decoder.compilations) > programs:
                self.logger.line(f"validation {describe_decoder(self.decoder)}")
        if values:
            self.logger.scalars("val", values, step)
            self.logger.line(f"step {step}/{cfg.trainer.max_steps} | validation | "
                             + " | ".join(f"{k} {v:.4f}" for k, v in values.items()))
        self.last = {"step": step, "values": values, "examples": scored[1] if scored else 0}
        if step == 0:
            self.first = self.last

    def compile_ahead(self) -> None:
        """Start XLA's compiles of the validation programs now, while other work goes on
        (:func:`~tpu_train.trainer.evaluation.compile_ahead_for_validation`): with several
        programs to compile (the train step's too), their compiles overlap. Errors are left
        to the validation pass, which builds what failed again and raises them there."""
        if not (self.job.cfg.trainer.val_every_n_steps and self.enabled()) \
                or (self.evaluator is None and self.decoder is None):
            return
        cfg = self.job.cfg
        try:
            val_batch = None
            # As __call__: where a host copy computes the loss, the evaluator is not used.
            if self.evaluator is not None and self.data.has_val_loss and self.host is None:
                loader = builders.build_val_loader(cfg, self.tokenizer, self.data.val_path,
                                                   probe=False)
                val_batch = next(iter(loader), None)
                if val_batch is not None:  # as the pass calls the program: full rows
                    val_batch = padded_rows(val_batch, loader.batch_size)
            decoding = Decoding(self.job.device, self.job.precision,
                                cfg.recipe.eval.max_new_tokens, self.decoder)
            exact_match = ExactMatchSet(self.tokenizer, self.data.exact_match_path,
                                        cfg.recipe.eval.exact_match_examples)
            compile_ahead_for_validation(self.model, self.evaluator, val_batch, exact_match,
                                         decoding)
        except Exception:  # noqa: BLE001 - the validation pass builds it again and raises
            pass

    def at_start(self, start_step: int) -> None:
        """Validate the starting model (step 0) when ``trainer.val_at_start``; a resumed run
        takes the first run's step-0 figures from ``metrics.jsonl`` instead."""
        trainer = self.job.cfg.trainer
        if not (trainer.val_every_n_steps and trainer.val_at_start and self.enabled()):
            return
        if start_step == 0:
            self(0)
            return
        values = self.logger.recorded("val", 0)
        if values:
            self.first = {"step": 0, "values": values, "examples": None}


def _write_config(job: Job) -> None:
    """The resolved config, composable again: ``tpu-train --config-dir RUN --config-name
    run_config`` re-runs (resumes) this run with exactly these settings."""
    config_file = job.run_dir / SAVED_CONFIG_FILE
    if not config_file.exists():
        header = ("# tpu-train --config-dir <this directory> --config-name run_config\n"
                  "defaults:\n  - config\n  - _self_\n")
        config_file.write_text(header + OmegaConf.to_yaml(job.cfg, resolve=True))


class _Throughput:
    """Tokens per second and, where the chip's peak is known, MFU of one step."""

    def __init__(self, job: Job, model: torch.nn.Module, logger: RunLogger):
        from tpu_train.models import family_of

        cfg = job.cfg
        self.tokens_per_step = (cfg.data.batch_size * cfg.data.seq_len
                                * cfg.trainer.grad_accum_steps)
        self.flops = family_of(model).flops_per_token(model.config, cfg.data.seq_len)
        self.peak = peak_bf16_tflops(detect_device_kind(job.device))
        if self.peak is None:
            logger.line(f"device {job.device}: peak bf16 throughput unknown, so MFU is unknown")

    def scalars(self, out: dict, loss: float, grad_norm: float,
                elapsed: float) -> dict[str, float]:
        scalars = {"loss": loss, "lr": float(out["lr"]), "grad_norm": grad_norm,
                   "step_time_s": elapsed,
                   "tokens_per_s": self.tokens_per_step / max(elapsed, 1e-9)}
        if self.peak is not None:
            scalars["mfu"] = scalars["tokens_per_s"] * self.flops / (self.peak * 1e12)
        return scalars


@dataclasses.dataclass(frozen=True)
class _Every:
    """What the loop checks every step, as plain values: read from the config once (one
    attribute of an OmegaConf node costs 5-10 us, and a step read about ten)."""

    max_steps: int
    grad_accum_steps: int
    log: int  # logging.every_n_steps
    validate: int  # trainer.val_every_n_steps (0: never)
    checkpoint: int  # checkpoint.every_n_steps

    @classmethod
    def of(cls, cfg) -> "_Every":
        trainer = cfg.trainer
        return cls(int(trainer.max_steps), int(trainer.grad_accum_steps),
                   int(cfg.logging.every_n_steps), int(trainer.val_every_n_steps or 0),
                   int(cfg.checkpoint.every_n_steps))


class _Loop:
    """One call of :func:`fit`: the training loop's own state beside the run's."""

    def __init__(self, run: Run):
        self.run = run
        self.job, self.parallel, self.step_fn = run.job, run.layout, run.step_fn
        self.model, self.optimizer, self.scheduler, self.data = \
            run.model, run.optimizer, run.scheduler, run.data
        self.start_step = start_step = run.step
        self.compilations = 0
        cfg = run.job.cfg
        self.every = _Every.of(cfg)
        self.checkpointer = run.checkpointer
        self.checkpointer.remove_stale_temporaries()
        self.batches = _training_batches(run.data.train, int(cfg.data.prefetch))
        self.ahead: BatchesAhead | None = None  # the loop's batches, once it runs
        self.logger = run.logger = RunLogger(run.job.run_dir, run.job.world.is_main, cfg.logging,
                                             cfg.trainer.max_steps, start_step)
        # metrics.jsonl ends at the resumed step (rows after it are replayed, not duplicated);
        # the count of skipped updates carries on from its last row.
        last = self.logger.truncate_metrics_after(start_step)
        self.skipped_updates = int(last.get("train/skipped_updates") or 0)
        self._rate_from = (start_step + 1, time.perf_counter())
        # The steady rate of this process's steps, for the closing block.
        self.steady = SteadyRate.of(run.job, run.model)

    @property
    def step(self) -> int:
        return self.run.step

    @step.setter
    def step(self, value: int) -> None:
        self.run.step = value

    def _eta(self, step: int) -> float | None:
        """Seconds to ``trainer.max_steps`` at the wall-clock rate since the first step of
        this run (validation and checkpoints included); None before there is a rate."""
        first, since = self._rate_from
        if step <= first:
            return None
        per_step = (time.perf_counter() - since) / (step - first)
        return per_step * (self.every.max_steps - step)

    def save(self) -> None:
        """A checkpoint of this step in the layout's format (every process calls this)."""
        data = self.ahead if self.ahead is not None else self.batches
        started = time.perf_counter()
        state = {"scheduler": self.scheduler.state_dict(), "data": data.state_dict(),
                 "rng": capture_rng_state(self.job.device)}
        self.parallel.save(self.run, state)
        self.checkpointer.times.saves += 1
        self.checkpointer.times.blocking_s += time.perf_counter() - started
        self.logger.sync()  # a run directory at a URL: the logs as far as this checkpoint

    def start_batches(self) -> None:
        """Start building batches ahead (``data.prefetch``) now, while the starting model is
        validated: the worker takes a second or two to start."""
        if self.step < self.every.max_steps and hasattr(self.batches, "start"):
            self.batches.start()

    def close(self) -> None:
        """Stop the prefetch worker, if any (idempotent); the data position saved after this
        is still that of the last batch a step consumed."""
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()

    def _log_compilations(self) -> int:
        """Log the train step's compilations since the last call; returns how many."""
        records = self.step_fn.compiled.compilations if self.step_fn.compiled is not None else []
        for record in records[self.compilations:]:
            self.logger.line(describe_compilation(record))
        new, self.compilations = len(records) - self.compilations, len(records)
        return new

    def _stop_on_non_finite(self, loss: float, grad_norm: float, finite: bool) -> None:
        """With ``trainer.on_nan=stop``: stop on a non-finite loss or gradient norm. The step
        did not apply that update (both steps check before updating), so nothing non-finite
        reached the parameters."""
        if finite or OnNonFinite(self.job.cfg.trainer.on_nan) is not OnNonFinite.stop:
            return
        self.checkpointer.wait()
        what = f"loss is {loss}" if not math.isfinite(loss) else \
            f"gradient norm is {grad_norm} (loss {loss})"
        raise TrainingStopped(
            f"{what} at step {self.step + 1}; the update was not applied. The last good "
            f"checkpoint is {last_good_checkpoint(self.job.run_dir, self.job.world.is_main)}. "
            "Lower optim.lr, "
            "check the data, or set trainer.on_nan=skip")

    def compile_ahead(self) -> None:
        """Start the compiled step's XLA compile now, for the first batch's shapes, so that it
        runs while the starting model is validated instead of after it (on a chip, the first
        validation's own compiles and XLA's compile of the step then overlap). Tracing and
        lowering happen here, as the first step would do them; the program is the same. The
        loader is rewound: the first step reads the same batch, and a checkpoint saved before
        it the same data position. Reading or tracing errors are left to the first step,
        which raises them where it always has (its OOM compile error too)."""
        # The loader itself, read before the prefetcher starts (see start_batches).
        loader = self.data.train
        if (self.step_fn.compiled is None or self.step >= self.every.max_steps
                or not hasattr(loader, "state_dict")):
            return
        try:
            self.step_fn.compile_ahead(saved_step.first_global_batch(loader, self.every.grad_accum_steps))
        except Exception:  # noqa: BLE001 - the first step reads and traces again, and raises
            pass

    def _run_step(self, batch) -> dict:
        """One step; a step too large for the device's memory (found when XLA compiles it)
        is a one-line :class:`ConfigError` naming the settings that would fit."""
        from tpu_train.compile import ProgramOutOfMemoryError

        try:
            return self.step_fn(batch)
        except ProgramOutOfMemoryError as error:
            import jax

            from tpu_train.planning.fit import out_of_memory_message

            raise ConfigError(out_of_memory_message(error, self.job.cfg,
                                                    jax.device_count())) from None

    def train(self, validate: _Validator, throughput: _Throughput) -> str | None:
        """Step to ``trainer.max_steps``; returns what stopped it early (a signal, or
        ``trainer.max_minutes``), if anything."""
        cfg, every, logger = self.job.cfg, self.every, self.logger
        batches = self.ahead = BatchesAhead(self.batches, self.step_fn, every.grad_accum_steps)
        profiler = _ProfileWindow(cfg.logging.profile_steps, logger)
        if (self.step_fn.compiled is not None and self.step < every.max_steps
                and not self.step_fn.compiled.compilations):  # none loaded (compile.executable)
            logger.line("tracing and compiling the train step (once per input shape) ...")
        # The prefetch worker stops with the loop, however it ends.
        with _StopRequest(cfg.trainer.max_minutes) as stop, profiler, contextlib.closing(self):
            while self.step < every.max_steps and stop.signal_name is None:
                batch = batches.next()
                profiler.before(self.step + 1)
                started = time.perf_counter()
                out = self._run_step(batch)
                if self.step + 1 < every.max_steps:
                    batches.put_next()  # its transfer runs while this step's program does
                loss = float(out["loss"])
                grad_norm = float(out["grad_norm"])
                finite = (bool(out["finite"]) if "finite" in out
                          else math.isfinite(loss) and math.isfinite(grad_norm))
                elapsed = time.perf_counter() - started
                profiler.after(self.step + 1)
                self.steady.record(elapsed, compiled=self._log_compilations() > 0)
                self._stop_on_non_finite(loss, grad_norm, finite)
                self.step += 1
                if not finite:
                    self.skipped_updates += 1
                scalars = throughput.scalars(out, loss, grad_norm, elapsed)
                scalars["skipped_updates"] = float(self.skipped_updates)
                self._after_step(scalars, finite, validate)
            if stop.signal_name is not None:
                self.save()
            return stop.signal_name

    def _after_step(self, scalars: dict[str, float], finite: bool, validate: _Validator) -> None:
        every, step, logger = self.every, self.step, self.logger
        logger.scalars("train", scalars, step)
        if step == self.start_step + 1:
            _log_memory(logger, self.parallel, self.model, self.optimizer, step)
        logger.advance(1, scalars["loss"])
        if not finite:
            logger.line(f"step {step}: loss is {scalars['loss']}, gradient norm "
                        f"{scalars['grad_norm']}; update skipped (trainer.on_nan=skip; "
                        f"{self.skipped_updates} skipped so far)")
        if step == self.start_step + 1:  # the first step compiles: the rate starts after it
            self._rate_from = (step, time.perf_counter())
        if step % every.log == 0 or step == every.max_steps:
            logger.line(format_log_line(step, every.max_steps, scalars, self._eta(step)))
        if every.validate and step % every.validate == 0:
            validate(step)
        if step % every.checkpoint == 0 or step == every.max_steps:
            self.save()


def _training_batches(loader, prefetch: int):
    """``loader``, or with ``data.prefetch`` > 0 a prefetcher that builds that many batches
    ahead while the step runs (read, tokenized and packed between steps, a batch of the
    default job took longer than its step on a TPU): a worker process for files
    (:class:`~tpu_train.data.worker.WorkerPrefetcher`), a thread for other loaders (random
    tokens cost next to nothing to make)."""
    if prefetch == 0:
        return loader
    from tpu_train.data.packing import PackedLoader

    if isinstance(loader, PackedLoader):
        from tpu_train.data.worker import WorkerPrefetcher

        return WorkerPrefetcher(loader, depth=prefetch)
    from tpu_train.data.prefetch import Prefetcher

    return Prefetcher(loader, depth=prefetch)


def fit(run: Run) -> Path:
    """Train ``run`` from ``run.step`` to ``trainer.max_steps``; returns the run directory.

    Validation runs on a host copy (``run.fresh_model()``) where the trained weights are not
    whole on a device; the export is ``run.model_to_export()``. Raises
    :class:`TrainingStopped` on a non-finite loss with ``trainer.on_nan=stop``.
    """
    job = run.job
    cfg, trainer = job.cfg, job.cfg.trainer
    if cfg.compile.save_executable is not None:  # compile only: nothing trains or is written
        saved_step.save(run)
        return job.run_dir
    if cfg.compile.executable is not None and run.step < trainer.max_steps:
        saved_step.load(run)  # a mismatch stops the job here, before anything is written
    # Everything is built and checked; from here on the run directory is written.
    superseded = []
    if job.world.is_main:
        if is_local(job.run_dir):  # an object store has no directories to make
            job.run_dir.mkdir(parents=True, exist_ok=True)
        _write_config(job)
        if run.resumed_from is not None:
            superseded = supersede_later(job.run_dir, run.step)
    loop = _Loop(run)
    logger = loop.logger
    try:
        logger.log_only(OmegaConf.to_yaml(cfg, resolve=True))
        logger.config(cfg)
        for note in job.notes:
            (logger.line if note.startswith("note: ") else logger.log_only)(note)
        for path in superseded:
            logger.line(f"moved {path.name.rsplit('-', 1)[0]} (after the resumed step) to {path}")
        for line in start_summary(run, run.layout.bytes_per_device(run.model, run.optimizer)):
            logger.line(line)
        validate = _Validator(run)
        # XLA compiles the validation programs and the train step side by side, on threads
        # of their own, while the starting model is validated (in the order they are needed).
        validate.compile_ahead()
        loop.compile_ahead()
        loop.start_batches()
        validate.at_start(loop.start_step)
        stopped_by = _train_or_say_how_to_resume(loop, validate, _Throughput(job, run.model,
                                                                             logger))
        steady = loop.steady.summary()
        if steady:
            logger.scalars("throughput", steady, run.step)
        records = run.step_fn.compiled.compilations if run.step_fn.compiled is not None else []
        if records:
            logger.scalars("startup", startup_seconds(records), run.step)
        run.checkpointer.wait()
        export_dir = None
        if stopped_by is not None:
            logger.line(f"stopped by {stopped_by} at step {run.step}; checkpoint saved. Resume "
                        f"with: {resume_command(job.run_dir, job.world.size)}")
        else:
            # The final model is always validated (a resumed, already finished run included).
            if (trainer.val_every_n_steps and validate.last.get("step") != run.step
                    and validate.enabled()):
                validate(run.step)
            if cfg.checkpoint.export_hf:
                export_dir = job.run_dir / "hf"
                _export(run, export_dir)
        logger.line(final_summary(run, export_dir, validate.last, validate.first,
                                  loop.steady.describe(steady) + describe_startup(records)))
    finally:
        loop.close()
        logger.close()
    return job.run_dir


def _train_or_say_how_to_resume(run: _Loop, validate: _Validator,
                                throughput: _Throughput) -> str | None:
    """``run.train``; a run that stops on an error says how to resume from its newest
    checkpoint (the default run.dir is a new timestamp each time: the command names it)."""
    job = run.job
    try:
        return run.train(validate, throughput)
    except Exception as exc:
        _finish_pending_save(run)
        if latest_checkpoint(job.run_dir) is None:
            raise
        how = f"resume with: {resume_command(job.run_dir, job.world.size)}"
        if isinstance(exc, TrainingStopped):
            raise TrainingStopped(f"{exc}; after the change, {how}") from exc
        run.logger.line(f"the run failed at step {run.step} ({type(exc).__name__}); its newest "
                        f"checkpoint is kept; {how}")
        raise


def _finish_pending_save(run: _Loop) -> None:
    """Let a checkpoint still being written in the background complete before the failed run
    names its newest checkpoint; a failure of that save is logged (the run's own error is
    the one raised)."""
    try:
        run.checkpointer.wait()
    except RuntimeError as error:
        run.logger.line(f"the checkpoint being written when the run failed was not saved: {error}")


def _log_memory(logger: RunLogger, parallel: Layout, model, optimizer, step: int) -> None:
    """``system/param_bytes_per_device`` (parameters + optimizer state, the busiest device)
    and the backend's peak, where it reports one; after the first step, when the optimizer
    state exists in every mode."""
    values = {"param_bytes_per_device": float(parallel.bytes_per_device(model, optimizer))}
    # A run on the host CPU holds nothing on a device: no backend is opened to ask.
    peak = None if parallel.device.type == "cpu" else peak_bytes_per_device()
    if peak is not None:
        values["peak_bytes_per_device"] = float(peak)
    logger.scalars("system", values, step)


def _export(run: Run, directory: Path) -> None:
    """Hugging Face export of the whole model and its tokenizer, written by process 0 (all
    gather for it)."""
    model = run.model_to_export()
    state = run.layout.full_model_state(model)
    if run.job.world.is_main:
        with staged_directory(directory) as local:  # at a URL: written here, then uploaded
            builders.export_pretrained(model, local, run.tokenizer, state_dict=state)
