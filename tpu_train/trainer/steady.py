"""A run's steady rate, for its closing block and ``metrics.jsonl``'s ``throughput/*`` row: the
median step time over the steps that compiled nothing, tokens/s and MFU at it, and the
wall-clock rate from the end of the first step (the work between steps included).

A step's time is its call until its loss is read on the host, as the benchmarks time one
(``scripts/bench_train_step.py``), so the figures compare with theirs
(``scripts/bench_cli_sizes.py``).
"""

from __future__ import annotations

import statistics
import time

import torch

from .metrics import detect_device_kind, peak_bf16_tflops


class SteadyRate:
    """Step times of one process's run, and the figures they give."""

    def __init__(self, tokens_per_step: int, flops_per_token: int, peak_tflops: float | None):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak_tflops = peak_tflops
        self.steady_times: list[float] = []
        self.steps = 0
        # (steps taken, perf_counter) at the end of the first step's and the last step's call.
        self._wall_from: tuple[int, float] | None = None
        self._wall_to: tuple[int, float] | None = None

    @classmethod
    def of(cls, job, model: torch.nn.Module) -> "SteadyRate":
        """For the run of ``job`` on ``model`` (FLOPs: its family's ``flops_per_token``); MFU
        where the chip's peak is known (:data:`tpu_train.trainer.metrics.PEAK_BF16_TFLOPS`)."""
        from tpu_train.models import family_of

        cfg = job.cfg
        tokens = cfg.data.batch_size * cfg.data.seq_len * cfg.trainer.grad_accum_steps
        flops = family_of(model).flops_per_token(model.config, cfg.data.seq_len)
        return cls(int(tokens), flops, peak_bf16_tflops(detect_device_kind(job.device)))

    def record(self, elapsed: float, compiled: bool) -> None:
        """One step's seconds; ``compiled``: the train step compiled during it. A process's
        first step is never steady (it compiles, or warms up in eager mode)."""
        self.steps += 1
        mark = (self.steps, time.perf_counter())
        if self.steps == 1:
            self._wall_from = mark
        else:
            self._wall_to = mark
            if not compiled:
                self.steady_times.append(elapsed)

    def summary(self) -> dict[str, float]:
        """The figures (``throughput/*`` in metrics.jsonl); {} before a second step."""
        if not self.steady_times:
            return {}
        median = statistics.median(self.steady_times)
        values = {"median_step_time_s": median, "fastest_step_time_s": min(self.steady_times),
                  "timed_steps": float(len(self.steady_times)),
                  "tokens_per_s": self.tokens_per_step / median}
        if self.peak_tflops is not None:
            values["mfu"] = (values["tokens_per_s"] * self.flops_per_token
                             / (self.peak_tflops * 1e12))
        (first, start), (last, end) = self._wall_from, self._wall_to
        values["wall_tokens_per_s"] = self.tokens_per_step * (last - first) / (end - start)
        return values

    def describe(self, values: dict[str, float]) -> list[tuple[str, str]]:
        """The closing block's rows for :meth:`summary`'s ``values``."""
        if not values:
            return [("throughput", "not measured: the run took one step, which compiles "
                                   "(two or more give the steady rate)")] if self.steps else []
        skipped = self.steps - int(values["timed_steps"])
        left_out = ("the first, which compiled" if skipped == 1
                    else f"{skipped} that compiled")
        mfu = f"MFU {values['mfu']:.1%}" if "mfu" in values else "MFU unknown"
        return [
            ("step time", f"median {values['median_step_time_s']:.4f} s, fastest "
                          f"{values['fastest_step_time_s']:.4f} s over {int(values['timed_steps'])}"
                          f" steps ({left_out}, not counted)"),
            ("throughput", f"{values['tokens_per_s']:,.0f} tokens/s at the median step, {mfu}; "
                           f"{values['wall_tokens_per_s']:,.0f} tokens/s by the wall clock after "
                           "the first step (logging, validation, checkpoints included)"),
        ]
