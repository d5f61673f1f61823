"""Training metrics: TensorBoard scalars, a compact log line, a progress bar and MFU.

MFU needs the chip's peak bf16 throughput.  The table below is explicit; a chip that is not in
it (the CPU, an unlisted accelerator) gets no MFU at all rather than a guessed one.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from .storage_urls import LocalMirror, RunPath, run_path

# Peak dense bf16 TFLOP/s per chip, from the vendors' published specifications.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "tpu v4": 275.0,
    "tpu v5e": 197.0,
    "tpu v5p": 459.0,
    "tpu v6e": 918.0,
    "tpu v7": 2307.0,
    "h100 sxm": 989.0,
    "h200 sxm": 989.0,
}

# How PJRT / JAX spell ``device_kind`` for the chips above.
_DEVICE_KIND_ALIASES: dict[str, str] = {
    "tpu v4": "tpu v4",
    "tpu v5 lite": "tpu v5e",
    "tpu v5e": "tpu v5e",
    "tpu v5": "tpu v5p",
    "tpu v5p": "tpu v5p",
    "tpu v6 lite": "tpu v6e",
    "tpu v6e": "tpu v6e",
    "tpu7x": "tpu v7",
    "tpu v7": "tpu v7",
    "tpu v7x": "tpu v7",
    "nvidia h100 80gb hbm3": "h100 sxm",
    "nvidia h100 sxm": "h100 sxm",
    "nvidia h200": "h200 sxm",
    "nvidia h200 sxm": "h200 sxm",
}


def chip_name(device_kind: str | None) -> str | None:
    """The key of :data:`PEAK_BF16_TFLOPS` for a PJRT ``device_kind`` string, or None."""
    if not device_kind:
        return None
    return _DEVICE_KIND_ALIASES.get(device_kind.strip().lower())


def peak_bf16_tflops(device_kind: str | None) -> float | None:
    """Peak bf16 TFLOP/s of one chip, or None when the chip is not in the table."""
    name = chip_name(device_kind)
    return None if name is None else PEAK_BF16_TFLOPS[name]


def detect_device_kind(device: torch.device) -> str | None:
    """PJRT's name of the chip behind ``device``; None for the CPU or when unknown."""
    if device.type == "cpu":
        return None
    try:
        import jax

        return str(jax.devices()[0].device_kind)
    except Exception:  # noqa: BLE001 - any failure means "unknown", which disables MFU
        return None


METRICS_FILE = "metrics.jsonl"
LOG_FILE = "train.log"
TENSORBOARD_SUBDIR = "tensorboard"


def metrics_record(step: int, values: dict[str, float]) -> dict:
    """One ``metrics.jsonl`` row: strict JSON, so a NaN or inf value is written as ``null``
    and flagged beside it (``"train/loss": null, "train/loss_nonfinite": "nan"``)."""
    record: dict = {"step": step}
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            record[key] = None
            record[f"{key}_nonfinite"] = repr(value)  # "nan", "inf" or "-inf"
        else:
            record[key] = value
    return record


def _eta_text(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_log_line(step: int, max_steps: int, scalars: dict[str, float],
                    eta_s: float | None = None) -> str:
    """``step 10/100 | loss 5.2311 | lr 3.00e-04 | ... | eta 1:23``: one line a human can scan
    (the ETA, in minutes:seconds or hours:minutes:seconds, once there is a rate)."""
    parts = [f"step {step}/{max_steps}"]
    formats = {
        "loss": "loss {:.4f}", "lr": "lr {:.2e}", "grad_norm": "grad_norm {:.3f}",
        "tokens_per_s": "{:,.0f} tok/s", "step_time_s": "{:.3f} s/step",
    }
    for key, template in formats.items():
        if key in scalars:
            parts.append(template.format(scalars[key]))
    parts.append(f"mfu {scalars['mfu']:.1%}" if "mfu" in scalars else "mfu unknown")
    if eta_s is not None and step < max_steps:
        parts.append(f"eta {_eta_text(eta_s)}")
    return " | ".join(parts)


class RunLogger:
    """Writes scalars to TensorBoard and lines to stdout and ``<run.dir>/train.log``.

    Every method is a no-op on processes other than rank 0. A run directory at a URL gets its
    files from a local copy (:class:`~tpu_train.trainer.storage_urls.LocalMirror`), uploaded
    every half minute or so, at every checkpoint (:meth:`sync`) and at :meth:`close`.
    """

    def __init__(self, run_dir: str | RunPath, enabled: bool, options, total_steps: int,
                 initial_step: int):
        """``options``: the ``logging`` config section (``tensorboard``, ``progress_bar``)."""
        tensorboard, progress_bar = bool(options.tensorboard), bool(options.progress_bar)
        self.enabled = enabled
        self.run_dir = run_path(run_dir)
        self._writer = None
        self._log_file: TextIO | None = None
        self._metrics_file: TextIO | None = None
        self._bar = None
        self._mirror: LocalMirror | None = None
        if not enabled:
            return
        self._mirror = LocalMirror(self.run_dir, (LOG_FILE, METRICS_FILE))
        self._log_file = open(self._mirror.local / LOG_FILE, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.local_tensorboard_dir))
        # Only on a terminal: in a redirected file the bar's redraws would interleave with
        # the log lines.
        if progress_bar and total_steps > initial_step and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, unit="step",
                             dynamic_ncols=True, file=sys.stderr, leave=False)

    @property
    def tensorboard_dir(self) -> RunPath:
        """Where TensorBoard's files end up (``tensorboard --logdir`` reads URLs too)."""
        return self.run_dir / TENSORBOARD_SUBDIR

    @property
    def local_tensorboard_dir(self) -> Path:
        """Where they are written (the run directory's, or its local copy's)."""
        return self._local_dir / TENSORBOARD_SUBDIR

    @property
    def metrics_path(self) -> Path:
        return self._local_dir / METRICS_FILE

    @property
    def _local_dir(self) -> RunPath:
        return self._mirror.local if self._mirror is not None else self.run_dir

    def sync(self, force: bool = True) -> None:
        """Upload the logs to a run directory at a URL (without ``force``: only when the last
        upload is half a minute old); nothing to do for a local one."""
        if self._mirror is None or not self._mirror.due(force):
            return
        if self._writer is not None:
            self._writer.flush()
        self._mirror.sync()

    def scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
        """TensorBoard scalars ``prefix/key``, and one exact, strict JSON line in
        ``metrics.jsonl`` (:func:`metrics_record`: a NaN or inf is written as ``null`` with a
        ``<key>_nonfinite`` flag)."""
        if not self.enabled:
            return
        record = metrics_record(step, {f"{prefix}/{k}": v for k, v in values.items()})
        # One handle for the run, opened at the first row (after truncate_metrics_after has
        # rewritten the file), each row written through at once: a crash loses no row, and a
        # step costs one write instead of an open and a close.
        if self._metrics_file is None:
            self._metrics_file = open(self.metrics_path, "a", encoding="utf-8")
        # json writes floats with repr(): they read back bit for bit.
        self._metrics_file.write(json.dumps(record, allow_nan=False) + "\n")
        self._metrics_file.flush()
        if self._writer is None:
            return
        # One TensorBoard event holding every value: add_scalar makes an event (protobufs, a
        # queue put waking the writer thread) per value, most of the loop's own host time
        # per step.
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=f"{prefix}/{key}", simple_value=float(value))
                                 for key, value in values.items()])
        self._writer.file_writer.add_summary(summary, step)

    def truncate_metrics_after(self, step: int) -> dict:
        """Drop the rows of ``metrics.jsonl`` after ``step`` (a run resumed from ``step``
        logs those steps again) and unreadable rows (a line cut by a crash); the file is
        rewritten atomically (process 0 only). Returns the last kept row with train scalars
        ({} if none)."""
        if not self.enabled or not self.metrics_path.is_file():
            return {}
        kept, last, changed = [], {}, False
        for line in self.metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
                keep = isinstance(record, dict) and int(record["step"]) <= step
            except (ValueError, KeyError, TypeError):
                keep = False
            if not keep:
                changed = True
                continue
            kept.append(line)
            if "train/loss" in record:
                last = record
        if changed:
            temporary = self.metrics_path.with_name(f".{METRICS_FILE}.tmp-{os.getpid()}")
            temporary.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
            with open(temporary, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(temporary, self.metrics_path)
        return last

    def line(self, text: str) -> None:
        """``text`` on stdout, and in ``train.log`` with the time it was written in front of
        each line (``2026-12-04 08:51:02``, local time)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)
        if self._log_file is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self._log_file.write("".join(f"{stamp} {line}\n" for line in text.split("\n")))
            self._log_file.flush()
            self.sync(force=False)

    def recorded(self, prefix: str, step: int) -> dict[str, float]:
        """The ``prefix/*`` values ``metrics.jsonl`` holds for ``step`` (a resumed run reads
        what the first run logged), without the prefix; {} if none."""
        if not self.enabled or not self.metrics_path.is_file():
            return {}
        values = {}
        for line in self.metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("step") == step:
                values.update({k[len(prefix) + 1:]: v for k, v in record.items()
                               if k.startswith(f"{prefix}/") and isinstance(v, (int, float))})
        return values

    def config(self, cfg) -> None:
        """The resolved config as TensorBoard text, and its scalar settings as hparams (the
        HParams tab compares runs by them)."""
        if self._writer is None:
            return
        from omegaconf import OmegaConf
        from torch.utils.tensorboard.summary import hparams

        text = OmegaConf.to_yaml(cfg, resolve=True)
        self._writer.add_text("config", "```yaml\n" + text + "```", 0)
        flat = {}

        def walk(node, prefix):
            for key, value in node.items():
                if isinstance(value, dict):
                    walk(value, f"{prefix}{key}.")
                elif isinstance(value, (bool, int, float, str)):
                    flat[f"{prefix}{key}"] = value

        walk(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "")
        experiment, start, end = hparams(flat, {"train/loss": 0.0})
        for summary in (experiment, start, end):
            self._writer.file_writer.add_summary(summary)

    def log_only(self, text: str) -> None:
        """Into ``train.log`` only (e.g. the resolved config: too long for the console)."""
        if self._log_file is not None:
            self._log_file.write(text.rstrip("\n") + "\n")
            self._log_file.flush()

    def advance(self, steps: int = 1, loss: float | None = None) -> None:
        if self._bar is None:
            return
        self._bar.update(steps)
        if loss is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None
