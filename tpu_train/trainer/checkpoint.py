"""Atomic, resumable training checkpoints.

Layout of one checkpoint, ``<run.dir>/checkpoints/step_00000050/``:

* ``model.safetensors``: the model's state dict (tensors only; loading runs no code);
* ``training_state.pt``: optimizer, scheduler, data-loader position and RNG states, read back
  with ``torch.load(weights_only=True)``;
* ``meta.json``: the step, the format version, the layout and the SHA-256 of every other file
  of the checkpoint (``files``: relative path -> hex digest). It is written last.

A job of several processes on one SPMD mesh writes the *sharded* layout instead: ``sharded/``
holds parameters and optimizer moments in ``torch.distributed.checkpoint`` format, every
process writing the shards on its own devices, and ``training_state.pt`` the rest (written by
process 0). Both layouts resume on any mesh and any number of processes.

A checkpoint is written into a hidden temporary directory, every file and the directory are
fsynced, and only then is it renamed to ``step_N``.  A crash at any point leaves either the
complete checkpoint or a temporary directory that :meth:`CheckpointManager.latest` ignores and
the next writer deletes. In a run directory at a URL (an object store: no rename,
:mod:`tpu_train.trainer.storage_urls`) ``step_N`` is written in place and ``meta.json`` is
its commit marker, written last: a ``step_N`` without it is an interrupted save, which is
never listed and which the next writer deletes.

Integrity: :func:`verify_checkpoint` re-hashes every file listed in ``meta.json`` and names
what is wrong (a missing, truncated or altered file, an unreadable ``meta.json``); resuming
falls back, with a warning, to the newest intact checkpoint. Checkpoints written before the
checksums existed (no ``files`` in ``meta.json``) still load: only the presence of their files
is checked. A checkpoint is only written from finite parameters and optimizer state
(:func:`non_finite_tensors`, checked by the training loop before it saves).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .errors import TrainingStopped
from .storage_urls import (RunPath, is_local, local_file, move_tree, remove_tree, run_path,
                           upload)

CHECKPOINTS_SUBDIR = "checkpoints"
MODEL_FILE = "model.safetensors"
TRAINING_STATE_FILE = "training_state.pt"
META_FILE = "meta.json"
SHARDED_DIR = "sharded"
FULL_LAYOUT, SHARDED_LAYOUT = "full", "sharded"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TEMP_PREFIX = ".tmp-"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def to_cpu(value: Any, owned: frozenset = frozenset()) -> Any:
    """A deep copy of ``value`` with every tensor cloned to the CPU (the async-save snapshot),
    but for the tensors whose ``id`` is in ``owned``: host copies made for this save, which
    nothing else writes, kept as they are."""
    if isinstance(value, torch.Tensor):
        if id(value) in owned:
            return value
        return value.detach().to("cpu", copy=True).contiguous()
    if isinstance(value, dict):
        return {key: to_cpu(item, owned) for key, item in value.items()}
    if isinstance(value, list):
        return [to_cpu(item, owned) for item in value]
    if isinstance(value, tuple):
        return tuple(to_cpu(item, owned) for item in value)
    return value


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def is_checkpoint(path: RunPath) -> bool:
    """True when ``path`` is a complete checkpoint directory of this format."""
    path = run_path(path)
    return (path / META_FILE).is_file() and (
        (path / MODEL_FILE).is_file() or (path / SHARDED_DIR / ".metadata").is_file())


def checkpoint_layout(path: RunPath) -> str:
    """``full`` (one model file) or ``sharded`` (written by several processes)."""
    return FULL_LAYOUT if (run_path(path) / MODEL_FILE).is_file() else SHARDED_LAYOUT


def file_sha256(path: RunPath) -> str:
    """Hex SHA-256 of one file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with run_path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checksums(directory: RunPath) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``directory`` except ``meta.json``.
    The files are hashed side by side (hashlib and file reads release the GIL): a checkpoint is
    a few large files, or many shards, and one core hashes ~0.5-1.4 GB/s."""
    files = [p for p in sorted(directory.rglob("*"))
             if p.is_file() and p.relative_to(directory).as_posix() != META_FILE]
    workers = max(1, min(len(files), os.cpu_count() or 1, 8))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        sums = list(pool.map(file_sha256, files))
    return {str(p.relative_to(directory).as_posix()): digest for p, digest in zip(files, sums)}


def read_meta(path: RunPath) -> dict:
    """``meta.json`` of checkpoint ``path``; ValueError naming the problem when unreadable."""
    try:
        meta = json.loads((run_path(path) / META_FILE).read_text())
    except FileNotFoundError:
        raise ValueError(f"{META_FILE} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{META_FILE} is unreadable ({exc})") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise ValueError(f"{META_FILE} is not a checkpoint description")
    return meta


def verify_checkpoint(path: str | RunPath) -> str | None:
    """None when checkpoint ``path`` is intact, else what is wrong with it (one line).

    Every file listed in ``meta.json`` must exist with its recorded SHA-256. A checkpoint
    written before the checksums existed has no ``files`` entry: only its files' presence is
    checked (it loads unverified).
    """
    path = run_path(path)
    try:
        meta = read_meta(path)
    except ValueError as exc:
        return str(exc)
    if meta.get("format") != FORMAT_VERSION:
        return f"checkpoint format {meta.get('format')!r} is not supported"
    files = meta.get("files")
    if files is None:  # an older checkpoint: no checksums recorded
        required = ([MODEL_FILE] if meta.get("layout", FULL_LAYOUT) == FULL_LAYOUT
                    else [f"{SHARDED_DIR}/.metadata"]) + [TRAINING_STATE_FILE]
        missing = [name for name in required if not (path / name).is_file()]
        return f"{missing[0]} is missing" if missing else None
    if not isinstance(files, dict) or TRAINING_STATE_FILE not in files:
        return f"{META_FILE} lists no valid files"
    for name, expected in sorted(files.items()):
        target = path / name
        if not target.is_file():
            return f"{name} is missing"
        if file_sha256(target) != expected:
            return f"{name} does not match its SHA-256 in {META_FILE} (truncated or altered)"
    return None


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite. A NaN or an inf anywhere makes the sum NaN or inf, so a
    finite sum (one pass, nothing allocated) settles it; only a non-finite sum, which finite
    values can also reach by overflowing, is checked element by element. (A 350M model's
    checkpoint on a 2-core host: 0.15 s, where ``isfinite(t).all()`` for every tensor took 2.2.)"""
    if math.isfinite(float(tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64
                                      else torch.float32))):
        return True
    return bool(torch.isfinite(tensor).all())


def non_finite_tensors(state: Any, prefix: str = "") -> list[str]:
    """Names (dotted paths) of the floating-point tensors in ``state`` holding a NaN or inf."""
    found = []
    if isinstance(state, torch.Tensor):
        if state.is_floating_point() and state.numel() and not _all_finite(state.detach()):
            found.append(prefix or "<tensor>")
    elif isinstance(state, dict):
        for key, value in state.items():
            found += non_finite_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            found += non_finite_tensors(value, f"{prefix}[{index}]")
    elif isinstance(state, float) and not math.isfinite(state):
        found.append(prefix or "<float>")
    return found


def list_checkpoints(run_dir: str | RunPath) -> list[tuple[int, RunPath]]:
    """Complete checkpoints under ``run_dir``, oldest first."""
    root = run_path(run_dir) / CHECKPOINTS_SUBDIR
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and is_checkpoint(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(run_dir: str | RunPath) -> RunPath | None:
    """The newest complete checkpoint under ``run_dir``, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def checkpoint_dirs(run_dir: str | RunPath) -> list[tuple[int, RunPath]]:
    """Every ``step_N`` directory under ``run_dir``, oldest first, damaged ones included.

    A local ``step_N`` name only ever appears by the rename that ends a complete save, so a
    directory here that is not intact (:func:`verify_checkpoint`) was damaged afterwards. At a
    URL, a ``step_N`` is listed once its ``meta.json`` (written last) exists.
    """
    root = run_path(run_dir) / CHECKPOINTS_SUBDIR
    if not root.is_dir():
        return []
    return sorted((int(match.group(1)), entry) for entry in root.iterdir()
                  if (match := _STEP_DIR.match(entry.name)) and entry.is_dir()
                  and (is_local(entry) or (entry / META_FILE).is_file()))


def latest_intact_checkpoint(run_dir: str | RunPath
                             ) -> tuple[RunPath | None, list[tuple[RunPath, str]]]:
    """(the newest checkpoint that passes :func:`verify_checkpoint` or None, the newer damaged
    ones with what is wrong with each, newest first)."""
    damaged = []
    for _, path in reversed(checkpoint_dirs(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path, damaged
        damaged.append((path, problem))
    return None, damaged


SUPERSEDED_SUBDIR = "superseded"


def supersede_later(run_dir: str | RunPath, step: int) -> list[RunPath]:
    """Move the checkpoints after ``step`` to ``checkpoints/superseded/`` (a run resumed from an
    earlier step must never resume from them again, and nothing is deleted). Damaged ones
    included: a run resumed past a damaged checkpoint writes that step again."""
    moved = []
    for found_step, path in checkpoint_dirs(run_dir):
        if found_step > step:
            target = path.parent / SUPERSEDED_SUBDIR / f"{path.name}-{uuid.uuid4().hex[:8]}"
            move_tree(path, target)
            moved.append(target)
    return moved


def write_checkpoint(directory: RunPath, step: int, model_state: dict[str, torch.Tensor],
                     training_state: dict) -> RunPath:
    """Write one checkpoint atomically into ``directory/step_N`` and return its path."""
    if not is_local(directory):
        return _write_checkpoint_in_place(directory / step_dir_name(step), step, model_state,
                                          training_state)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / step_dir_name(step)
    if final.exists():
        # The same step was already saved (e.g. a signal right after a periodic save).
        return final
    temporary = directory / f"{_TEMP_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
    temporary.mkdir()
    try:
        save_file(model_state, str(temporary / MODEL_FILE))
        _finish(temporary, final, step, training_state, (MODEL_FILE,))
    except BaseException:
        remove_tree(temporary)
        raise
    return final


def _write_checkpoint_in_place(final: RunPath, step: int, model_state: dict,
                               training_state: dict) -> RunPath:
    """A checkpoint at a URL: each file written to a local temporary file, hashed and
    uploaded (one at a time: the local disk holds one file at most), ``meta.json`` last."""
    if is_checkpoint(final):
        return final
    remove_tree(final)  # an interrupted save of this step
    writers = ((MODEL_FILE, lambda local: save_file(model_state, str(local))),
               (TRAINING_STATE_FILE, lambda local: torch.save(training_state, local)))
    sums = {}
    with tempfile.TemporaryDirectory(prefix="tpu-train-checkpoint-") as staging:
        for name, write in writers:
            local = Path(staging) / name
            write(local)
            sums[name] = file_sha256(local)
            upload(local, final / name)
            local.unlink()
    _write_meta(final, step, FULL_LAYOUT, sums)
    return final


def _write_meta(directory: RunPath, step: int, layout: str, sums: dict[str, str]) -> None:
    meta = {"format": FORMAT_VERSION, "step": step, "layout": layout, "torch": torch.__version__,
            "files": sums}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def _finish(temporary: Path, final: Path, step: int, training_state: dict,
            written: tuple[str, ...]) -> None:
    """Write the training state and meta into ``temporary``, fsync, rename to ``final``.
    ``written``: the files already there besides the shards (the full layout's model file)."""
    layout = FULL_LAYOUT if MODEL_FILE in written else SHARDED_LAYOUT
    torch.save(training_state, temporary / TRAINING_STATE_FILE)
    for name in (*written, TRAINING_STATE_FILE):
        if (temporary / name).is_file():
            _fsync_file(temporary / name)
    # Hashed from the disk once every file (every process's shards included) is complete:
    # the sums describe what a resume will read back. meta.json is written last.
    _write_meta(temporary, step, layout, checksums(temporary))
    _fsync_file(temporary / META_FILE)
    _fsync_dir(temporary)
    os.rename(temporary, final)
    _fsync_dir(final.parent)


def write_sharded_checkpoint(directory: RunPath, step: int, save_shards, training_state: dict,
                             world) -> RunPath:
    """Every process of ``world`` calls this; ``save_shards(path)`` writes this process's shards
    (a collective). Process 0 then adds the training state and renames the directory (at a
    URL: writes ``meta.json`` last, in place)."""
    from .world import barrier

    final = directory / step_dir_name(step)
    if not is_local(directory):
        return _write_sharded_in_place(final, step, save_shards, training_state, world)
    if final.exists():  # every process sees the same (shared) directory
        return final
    # One name all processes agree on; a leftover of a crashed save is removed first.
    temporary = directory / f"{_TEMP_PREFIX}{step_dir_name(step)}"
    if world.is_main:
        remove_tree(temporary)
        temporary.mkdir(parents=True)
    barrier(world)
    save_shards(temporary / SHARDED_DIR)
    if world.is_main:
        _finish(temporary, final, step, training_state, ())
    barrier(world)
    return final


def _write_sharded_in_place(final: RunPath, step: int, save_shards, training_state: dict,
                            world) -> RunPath:
    """:func:`write_sharded_checkpoint` at a URL: the shards straight to the store, then
    process 0 writes the training state and, hashed from the store, ``meta.json`` last."""
    from .world import barrier

    if is_checkpoint(final):  # every process sees the same store
        return final
    if world.is_main:
        remove_tree(final)  # an interrupted save of this step
    barrier(world)
    save_shards(final / SHARDED_DIR)
    if world.is_main:
        with (final / TRAINING_STATE_FILE).open("wb") as handle:
            torch.save(training_state, handle)
        _write_meta(final, step, SHARDED_LAYOUT, checksums(final))
    barrier(world)
    return final


def read_checkpoint(path: str | RunPath) -> tuple[dict[str, torch.Tensor] | None, dict, dict]:
    """(model state, training state, meta) of a checkpoint; executes no code from the files.

    The model state is None for the sharded layout: its tensors are read into the placed
    step (``tpu_train.parallel.sharded_checkpoint.load_sharded(path / SHARDED_DIR, step)``).
    """
    path = run_path(path)
    if not is_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (expected {META_FILE} and {MODEL_FILE})"
        )
    meta = read_meta(path)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: checkpoint format {meta.get('format')!r} is not supported "
            f"(this version reads format {FORMAT_VERSION})"
        )
    model_state = (_load_model_file(path) if checkpoint_layout(path) == FULL_LAYOUT else None)
    return model_state, _load_training_state(path), meta


def _load_model_file(checkpoint: RunPath) -> dict[str, torch.Tensor]:
    with local_file(checkpoint / MODEL_FILE) as local:
        return load_file(str(local))


def _load_training_state(checkpoint: RunPath) -> dict:
    with (checkpoint / TRAINING_STATE_FILE).open("rb") as handle:
        return torch.load(handle, map_location="cpu", weights_only=True)


def read_model_state(path: str | RunPath) -> dict[str, torch.Tensor]:
    """Parameters only (for fine-tuning from a training checkpoint)."""
    path = run_path(path)
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {META_FILE})")
    if checkpoint_layout(path) == SHARDED_LAYOUT:
        raise ValueError(f"{path} is a sharded checkpoint; start from its run's hf/ export, or "
                         "resume the run itself with run.dir")
    problem = verify_checkpoint(path)
    if problem is not None:
        raise ValueError(f"{path} is damaged ({problem}); choose another checkpoint")
    try:
        return _load_model_file(path)
    except Exception as exc:  # noqa: BLE001 - an unverified (older) checkpoint that is damaged
        detail = str(exc).splitlines()[0] if str(exc) else "no detail"
        raise ValueError(f"{path / MODEL_FILE} cannot be read ({type(exc).__name__}: {detail}); "
                         "choose another checkpoint") from None


@dataclasses.dataclass
class SaveTimes:
    """Where a run's checkpoint saves spent their time (the closing block reports it)."""

    saves: int = 0
    # On the training loop: copies to the host, checks, waiting for the previous save, and the
    # writing itself when it is not in the background.
    blocking_s: float = 0.0
    # Writing, hashing and syncing the files on the background thread while training went on.
    background_s: float = 0.0

    def describe(self) -> str | None:
        """``1: 4.6 s of the training loop's time, 12.1 s more written in the background``."""
        if not self.saves:
            return None
        text = f"{self.saves}: {_seconds(self.blocking_s)} of the training loop's time"
        if self.background_s:
            text += f", {_seconds(self.background_s)} more written in the background"
        return text


def _seconds(value: float) -> str:
    """``12.1 s``, ``0.04 s``: tenths of a second, hundredths under one second."""
    return f"{value:.1f} s" if value >= 1 else f"{value:.2f} s"


class CheckpointManager:
    """Saves checkpoints of one run, keeps the last ``keep_last`` and optionally writes in the
    background.

    Only the writer process (rank 0) touches the disk; others call :meth:`save` as a no-op so
    that every process runs the same code path.
    """

    def __init__(self, run_dir: str | RunPath, keep_last: int, async_save: bool = False,
                 is_writer: bool = True):
        self.directory = run_path(run_dir) / CHECKPOINTS_SUBDIR
        self.keep_last = keep_last
        self.async_save = async_save
        self.is_writer = is_writer
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_saved: RunPath | None = None
        self.times = SaveTimes()

    def remove_stale_temporaries(self) -> None:
        """Delete the leftovers of saves that were interrupted by a crash (at a URL: the
        ``step_N`` without a ``meta.json``)."""
        if not self.is_writer or not self.directory.is_dir():
            return
        for entry in self.directory.iterdir():
            if entry.name.startswith(_TEMP_PREFIX) or (
                    not is_local(entry) and _STEP_DIR.match(entry.name)
                    and not (entry / META_FILE).is_file()):
                remove_tree(entry)

    def save(self, step: int, model_state: dict[str, torch.Tensor], training_state: dict,
             owned: frozenset = frozenset()) -> None:
        """Snapshot to CPU now, then write (on a background thread when ``async_save``).
        ``owned``: ids of the tensors that are already this save's own host copies (the
        snapshot keeps them instead of copying them again: :func:`to_cpu`)."""
        if not self.is_writer:
            return
        self.wait()
        model_snapshot = to_cpu(model_state, owned)
        state_snapshot = to_cpu(training_state, owned)
        if not self.async_save:
            self._write(step, model_snapshot, state_snapshot)
            return
        self._thread = threading.Thread(
            target=self._write_in_background, args=(step, model_snapshot, state_snapshot),
            name=f"checkpoint-step-{step}", daemon=False,
        )
        self._thread.start()

    def save_sharded(self, step: int, save_shards, training_state: dict, world) -> None:
        """A sharded checkpoint (every process calls it; see :func:`write_sharded_checkpoint`)."""
        self.wait()
        self.last_saved = write_sharded_checkpoint(self.directory, step, save_shards,
                                                   to_cpu(training_state), world)
        if self.is_writer:
            self._prune()

    def _write_in_background(self, step: int, model_state: dict, training_state: dict) -> None:
        started = time.perf_counter()
        try:
            self._write(step, model_state, training_state)
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait() on the main thread
            self._error = exc
        self.times.background_s += time.perf_counter() - started

    def _write(self, step: int, model_state: dict, training_state: dict) -> None:
        self.last_saved = write_checkpoint(self.directory, step, model_state, training_state)
        self._prune()

    def _prune(self) -> None:
        found = list_checkpoints(self.directory.parent)
        for _, path in found[: max(0, len(found) - self.keep_last)]:
            remove_tree(path)

    def wait(self) -> None:
        """Block until a background save has finished; re-raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"saving a checkpoint failed: {error}") from error


def last_good_checkpoint(run_dir: RunPath, read_back: bool = True) -> str:
    """The newest intact checkpoint of ``run_dir`` (its SHA-256 sums verified), as text for a
    stop message. Checkpoints are only written from finite state; with ``read_back`` a full
    one is also read and checked to hold finite values (process 0 only: each would read it)."""
    path, _ = latest_intact_checkpoint(run_dir)
    if path is None:
        return "none (no checkpoint was saved yet)"
    if read_back and checkpoint_layout(path) == FULL_LAYOUT:
        state = _load_training_state(path)
        bad = non_finite_tensors(_load_model_file(path)) + \
            non_finite_tensors(state.get("optimizer", {}), "optimizer")
        if bad:
            return f"{path} (WARNING: it holds non-finite values in {bad[0]})"
    return f"{path} (verified)"


def refuse_non_finite(bad: list[str], step: int, run_dir: RunPath, read_back: bool) -> None:
    """Refuse to checkpoint NaN/inf parameters or optimizer state (``bad`` names them): stop
    naming the last good checkpoint instead (a run resumed from a non-finite checkpoint could
    never recover)."""
    if bad:
        raise TrainingStopped(
            f"the parameters or optimizer state hold non-finite values at step {step} "
            f"({bad[0]}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}); no checkpoint "
            f"was written. The last good checkpoint is {last_good_checkpoint(run_dir, read_back)}")
