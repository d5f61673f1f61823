"""The training loop shared by the pretrain, finetune and LoRA recipes."""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from tpu_train.parallel.activation_checkpointing import apply_activation_checkpointing

from . import builders
from .checkpoint import CheckpointManager, latest_checkpoint, read_checkpoint
from .config import OnNonFinite, Precision, StepMode
from .errors import ConfigError, TrainingStopped
from .evaluation import HostEvaluationModel, exact_match_count, runs_on_host_cpu, validation_loss
from .lora import apply_lora, merge_lora
from .metrics import (
    RunLogger, detect_device_kind, format_log_line, is_main_process, peak_bf16_tflops,
)
from .optim import build_optimizer
from .rng import capture_rng_state, restore_rng_state, seed_everything
from .schedules import build_scheduler
from .step import build_train_step
from .validation import validate_config


def resolve_run_dir(cfg: DictConfig) -> Path:
    """``run.dir``; in a Hydra multirun, the job's own ``<run.dir>/<job number>``."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            return Path(HydraConfig.get().runtime.output_dir)
    except ImportError:
        pass
    return Path(cfg.run.dir)


class _StopRequest:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train(cfg: DictConfig, lora: bool = False) -> Path:
    """Train according to ``cfg``; resume from ``run.dir`` when it holds a checkpoint.

    Returns the run directory.  Raises :class:`ConfigError` (before anything is written) for
    bad configuration or data, and :class:`TrainingStopped` on a non-finite loss.
    """
    validate_config(cfg)
    trainer_cfg = cfg.trainer
    mode, precision = StepMode(trainer_cfg.mode), Precision(trainer_cfg.precision)
    on_nan = OnNonFinite(trainer_cfg.on_nan)
    if mode is StepMode.eager and any(cfg.parallel[a] > 1 for a in ("data", "fsdp", "tensor")):
        raise ConfigError(
            "parallel degrees > 1 need the SPMD compiled step; set trainer.mode=compiled or "
            "set parallel.data/fsdp/tensor to 1 or -1"
        )
    device = builders.resolve_device(trainer_cfg.device)
    if trainer_cfg.cpu_threads is not None:
        torch.set_num_threads(trainer_cfg.cpu_threads)
    seed_everything(trainer_cfg.seed)
    tokenizer = builders.build_tokenizer(cfg)
    train_path, val_path = builders.data_paths(cfg)
    train_loader = builders.build_train_loader(cfg, tokenizer, train_path)
    val_loader = builders.build_val_loader(cfg, tokenizer, val_path)
    exact_match_path = val_path if builders.first_record_kind(val_path) in ("instruction", "chat") else None

    def with_adapters(model: torch.nn.Module) -> torch.nn.Module:
        if lora:
            try:
                apply_lora(model, list(cfg.recipe.lora.targets), cfg.recipe.lora.rank,
                           cfg.recipe.lora.alpha, cfg.recipe.lora.dropout)
            except ValueError as exc:
                raise ConfigError(f"recipe.lora.targets: {exc}") from exc
        return model

    model = with_adapters(builders.build_model(cfg, tokenizer.vocab_size))
    source = (str(cfg.model.checkpoint) if cfg.model.checkpoint is not None
              else f"random initialization (seed {trainer_cfg.seed})")
    if trainer_cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    model.to(device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.scheduler, trainer_cfg.max_steps)

    run_dir = resolve_run_dir(cfg)
    step = 0
    resume_from = latest_checkpoint(run_dir)
    if resume_from is not None:
        model_state, training_state, meta = read_checkpoint(resume_from)
        try:
            model.load_state_dict(model_state)
            optimizer.load_state_dict(training_state["optimizer"])
            scheduler.load_state_dict(training_state["scheduler"])
            train_loader.load_state_dict(training_state["data"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise ConfigError(
                f"run.dir={str(run_dir)!r} holds a checkpoint of a different configuration "
                f"({str(exc).splitlines()[0]}); use a new run.dir or the original settings"
            ) from exc
        restore_rng_state(training_state["rng"], device)
        step = int(meta["step"])
    step_fn = build_train_step(mode, model, optimizer, scheduler, device, precision,
                               trainer_cfg.max_grad_norm, trainer_cfg.grad_accum_steps,
                               skip_non_finite=on_nan is OnNonFinite.skip)

    # Everything is built and checked; from here on the run directory is written.
    main_process = is_main_process()
    if main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        config_file = run_dir / "config.yaml"
        if not config_file.exists():
            config_file.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    checkpoints = CheckpointManager(run_dir, cfg.checkpoint.keep_last, cfg.checkpoint.async_save,
                                    is_writer=main_process)
    checkpoints.remove_stale_temporaries()
    logger = RunLogger(run_dir, main_process, cfg.logging.tensorboard, cfg.logging.progress_bar,
                       trainer_cfg.max_steps, step)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * trainer_cfg.grad_accum_steps
    peak = peak_bf16_tflops(detect_device_kind(device))
    from tpu_train.models import flops_per_token

    flops = flops_per_token(model.config, cfg.data.seq_len)
    logger.line(f"run dir: {run_dir}" + (f" (resumed from {resume_from.name})" if resume_from else ""))
    if peak is None:
        logger.line(f"device {device}: peak bf16 throughput unknown, so MFU is unknown")

    def save() -> None:
        training_state = {
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "data": train_loader.state_dict(), "rng": capture_rng_state(device),
        }
        checkpoints.save(step, model.state_dict(), training_state)

    last_validation: dict = {}
    host_model = (HostEvaluationModel(lambda: with_adapters(builders.build_model(
        cfg, tokenizer.vocab_size, allow_checkpoint=False))) if runs_on_host_cpu(device) else None)

    def validate_now() -> None:
        values = {}
        eval_model, eval_device = model, device
        if host_model is not None:
            eval_model, eval_device = host_model.refresh(model), torch.device("cpu")
        if val_loader is not None:
            # A fresh pass over the validation file each time (a loader is one stream).
            loader = builders.build_val_loader(cfg, tokenizer, val_path, probe=False)
            values.update(validation_loss(eval_model, loader, eval_device, trainer_cfg.val_batches,
                                          precision))
        scored = None
        if exact_match_path is not None:
            scored = exact_match_count(eval_model, tokenizer, exact_match_path, eval_device,
                                       cfg.recipe.eval.exact_match_examples,
                                       cfg.recipe.eval.max_new_tokens)
            if scored is not None:
                values["exact_match"] = scored[0]
        if values:
            logger.scalars("val", values, step)
            logger.line(f"step {step}/{trainer_cfg.max_steps} | validation | "
                        + " | ".join(f"{k} {v:.4f}" for k, v in values.items()))
        last_validation.clear()
        last_validation.update(step=step, values=values, examples=scored[1] if scored else 0)

    batches = iter(train_loader)
    stopped_by = None
    try:
        with _StopRequest() as stop:
            while step < trainer_cfg.max_steps and stop.signal_name is None:
                micro = [{k: v.to(device) for k, v in next(batches).items()}
                         for _ in range(trainer_cfg.grad_accum_steps)]
                started = time.perf_counter()
                out = step_fn(micro)
                loss = float(out["loss"])
                elapsed = time.perf_counter() - started
                if not math.isfinite(loss) and on_nan is OnNonFinite.stop:
                    checkpoints.wait()
                    last = latest_checkpoint(run_dir)
                    raise TrainingStopped(
                        f"loss is {loss} at step {step + 1}; the last good checkpoint is "
                        f"{last if last else 'none (no checkpoint was saved yet)'}. Lower optim.lr, "
                        "check the data, or set trainer.on_nan=skip"
                    )
                step += 1
                scalars = {"loss": loss, "lr": float(out["lr"]),
                           "grad_norm": float(out["grad_norm"]), "step_time_s": elapsed,
                           "tokens_per_s": tokens_per_step / max(elapsed, 1e-9)}
                if peak is not None:
                    scalars["mfu"] = scalars["tokens_per_s"] * flops / (peak * 1e12)
                logger.scalars("train", scalars, step)
                logger.advance(1, loss)
                if not math.isfinite(loss):
                    logger.line(f"step {step}: loss is {loss}; update skipped (trainer.on_nan=skip)")
                if step % cfg.logging.every_n_steps == 0 or step == trainer_cfg.max_steps:
                    logger.line(format_log_line(step, trainer_cfg.max_steps, scalars))
                if trainer_cfg.val_every_n_steps and step % trainer_cfg.val_every_n_steps == 0:
                    validate_now()
                if step % cfg.checkpoint.every_n_steps == 0 or step == trainer_cfg.max_steps:
                    save()
            stopped_by = stop.signal_name
            if stopped_by is not None:
                save()
        checkpoints.wait()
        export_dir = None
        if stopped_by is not None:
            logger.line(f"stopped by {stopped_by} at step {step}; checkpoint saved, rerun the "
                        "same command to resume")
        else:
            # The final model is always validated (a resumed, already finished run included).
            if (trainer_cfg.val_every_n_steps and last_validation.get("step") != step
                    and (val_loader is not None or exact_match_path is not None)):
                validate_now()
            if main_process and cfg.checkpoint.export_hf:
                export_dir = run_dir / "hf"
                _export(merge_lora(model) if lora else model, export_dir, tokenizer)
        last = latest_checkpoint(run_dir)
        logger.line(_summary(run_dir, logger, step, trainer_cfg.max_steps, last, export_dir,
                             last_validation, source))
    finally:
        logger.close()
    return run_dir


def _summary(run_dir: Path, logger: RunLogger, step: int, max_steps: int, checkpoint: Path | None,
             export_dir: Path | None, validation: dict, source: str) -> str:
    """The closing block: where everything is, and the final validation figures."""
    rows = [("run dir", str(run_dir)), ("started from", source),
            ("train log", str(run_dir / "train.log")),
            ("tensorboard", f"{logger.tensorboard_dir} (tensorboard --logdir {logger.tensorboard_dir})"
             if logger.tensorboard_dir.is_dir() else "off (logging.tensorboard=false)"),
            ("checkpoint", str(checkpoint) if checkpoint else "none"),
            ("hf export", str(export_dir) if export_dir else "none")]
    values = validation.get("values") or {}
    if validation.get("step") == step and values:
        figures = []
        if "exact_match" in values:
            figures.append(f"exact match {values['exact_match']:.1%} on "
                           f"{validation['examples']} held-out examples")
        if "loss" in values:
            figures.append(f"loss {values['loss']:.4f}")
        rows.append((f"validation at step {step}", ", ".join(figures)))
    width = max(len(key) for key, _ in rows)
    lines = [f"finished step {step}/{max_steps}" if step >= max_steps else f"stopped at step {step}/{max_steps}"]
    lines += [f"  {key + ':':<{width + 1}} {value}" for key, value in rows]
    return "\n".join(lines)


def _export(model: torch.nn.Module, directory: Path, tokenizer) -> None:
    from tpu_train.models import save_pretrained

    save_pretrained(model, directory, eos_token_id=tokenizer.eos_id)
