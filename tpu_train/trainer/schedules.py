"""Learning-rate schedules as picklable multipliers of the base learning rate.

They are callable objects rather than closures so that ``LambdaLR.state_dict()`` records their
parameters and a resumed run checks it rebuilt the same schedule.
"""

from __future__ import annotations

import math

import torch

from .config import ScheduleName, SchedulerConfig


class WarmupCosine:
    """Linear warmup from 0 to 1 over ``warmup_steps``, then cosine decay to ``min_ratio``."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float):
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupStableDecay:
    """Linear warmup, a constant plateau, then linear decay to ``min_ratio`` over the last
    ``decay_fraction`` of ``total_steps`` (the WSD schedule)."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float,
                 decay_fraction: float):
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = min_ratio
        self.decay_steps = max(1, round(total_steps * decay_fraction))

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_start = max(self.warmup_steps, self.total_steps - self.decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start + 1) / self.decay_steps)
        return 1.0 - (1.0 - self.min_ratio) * progress


class WarmupConstant:
    """Linear warmup, then a constant multiplier of 1."""

    def __init__(self, warmup_steps: int):
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return 1.0


def lr_multiplier(cfg: SchedulerConfig, max_steps: int):
    """The schedule named by ``cfg`` for a run of ``max_steps`` optimizer steps."""
    name = ScheduleName(cfg.name) if not isinstance(cfg.name, ScheduleName) else cfg.name
    warmup = effective_warmup(cfg, max_steps)
    if name is ScheduleName.warmup_cosine:
        return WarmupCosine(warmup, max_steps, cfg.min_lr_ratio)
    if name is ScheduleName.wsd:
        return WarmupStableDecay(warmup, max_steps, cfg.min_lr_ratio, cfg.decay_fraction)
    return WarmupConstant(warmup)


def effective_warmup(cfg: SchedulerConfig, max_steps: int) -> int:
    """``scheduler.warmup_steps``, clamped to a tenth of a run shorter than the warmup (a
    5-step smoke run keeps a warmup instead of failing or never reaching the peak lr)."""
    if cfg.warmup_steps <= max_steps:
        return cfg.warmup_steps
    return max(1, max_steps // 10)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig,
                    max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` applying :func:`lr_multiplier`; call ``step()`` once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg, max_steps))


def continue_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: SchedulerConfig,
                      max_steps: int, step: int) -> str | None:
    """After ``scheduler.load_state_dict``: the resumed schedule ends where the checkpoint's
    run ended. A larger ``trainer.max_steps`` would train its extra steps at that schedule's
    final rate (0 under WSD), so it is refused, naming that rate, unless
    ``scheduler.extend=true`` recomputes the schedule for ``max_steps`` (the rate then follows
    the longer schedule from ``step`` on; returns the note that says so)."""
    saved_total = max((getattr(f, "total_steps", 0) for f in scheduler.lr_lambdas), default=0)
    if not saved_total or max_steps <= saved_total:
        return None
    base = scheduler.base_lrs[0]
    old_lr = base * scheduler.lr_lambdas[0](max(step, saved_total))
    if not cfg.extend:
        from .errors import ConfigError

        raise ConfigError(
            f"trainer.max_steps={max_steps} goes past the resumed schedule, which ends at step "
            f"{saved_total}: steps {max(step, saved_total) + 1}-{max_steps} would train at lr "
            f"{old_lr:.3g}; set scheduler.extend=true to recompute the schedule for "
            f"{max_steps} steps, or keep trainer.max_steps={saved_total}")
    scheduler.lr_lambdas = [lr_multiplier(cfg, max_steps) for _ in scheduler.lr_lambdas]
    # The rate of the next step, as LambdaLR.step() would have set it (the step reads the
    # optimizer's lr).
    rates = [lr * f(scheduler.last_epoch) for lr, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates
    return (f"note: scheduler.extend=true: the schedule now ends at step {max_steps} instead of "
            f"{saved_total}; lr {old_lr:.3g} -> {rates[0]:.3g} at step {step + 1}")
