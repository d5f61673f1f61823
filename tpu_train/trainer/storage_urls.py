"""Run directories at fsspec URLs (``run.dir=gs://bucket/runs/x``, ``s3://``, ``memory://``).

A plain path, or a ``file://`` URL, is a local :class:`pathlib.Path`, written as before
(checkpoints into a temporary directory, fsynced and renamed). Any other URL becomes a
:class:`upath.UPath` over the protocol's fsspec filesystem (gcsfs for ``gs://``); the rest of
the trainer reads and lists it through the same path methods. An object store has neither
rename nor append, so:

* a checkpoint is written in place and its ``meta.json`` last: that object is the commit
  marker, and a ``step_N`` without it is an interrupted save, never resumed
  (:mod:`tpu_train.trainer.checkpoint`);
* files a library can only write to a local path (safetensors, the Hugging Face export) are
  written to a local temporary file or directory and uploaded (:func:`upload`,
  :func:`staged_directory`);
* ``train.log``, ``metrics.jsonl`` and TensorBoard's event files are written in a local
  directory and uploaded whole by :class:`LocalMirror`, at most every
  :data:`SYNC_INTERVAL_S` and at every checkpoint and the end. Appending per line or per
  event would rewrite the object each time (objects are immutable), and GCS allows about one
  write per second to one object; TensorBoard's own fsspec support
  (``tensorboard.compat.tensorflow_stub.io.gfile.FSSpecFileSystem``) opens the event file for
  append at every write of its writer, so it is not used.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator, Union

import fsspec
from upath import UPath

from .errors import ConfigError

RunPath = Union[Path, UPath]
# The local protocols: a file:// URL is the local path it names.
_LOCAL_PROTOCOLS = ("file", "local")
# The package that serves a protocol, where it is worth naming in the error.
_PACKAGES = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "s3a": "s3fs", "az": "adlfs",
             "abfs": "adlfs", "abfss": "adlfs"}
# tpu_train's extra that installs a protocol's package.
_EXTRAS = {"gcsfs": "gcs"}
# Seconds between two uploads of the run's logs (LocalMirror.due without force).
SYNC_INTERVAL_S = 30.0


def protocol_of(text: str) -> str | None:
    """``gs`` for ``gs://bucket/x``; None for a plain path."""
    protocol, _ = fsspec.core.split_protocol(str(text))
    return protocol


def is_url(text: str | RunPath) -> bool:
    """True for a URL of a filesystem other than the local one (``file://`` is local)."""
    if isinstance(text, UPath):
        return True
    if isinstance(text, Path):
        return False
    return protocol_of(str(text)) not in (None, *_LOCAL_PROTOCOLS)


def url_problem(text: str) -> str | None:
    """Why the URL ``text`` cannot be opened here (one line: the package to install, or an
    unknown protocol), or None when its filesystem is available."""
    protocol = protocol_of(text)
    if protocol is None or protocol in _LOCAL_PROTOCOLS:
        return None
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return (f"unknown storage protocol {protocol}://; use a local path or a URL of a "
                "filesystem fsspec knows (gs://, s3://, memory://, ...)")
    except ImportError as exc:
        package = _PACKAGES.get(protocol)
        if package is None:
            return f"{protocol}:// cannot be opened ({exc})"
        extra = _EXTRAS.get(package)
        also = f" (or pip install 'tpu_train[{extra}]')" if extra else ""
        return f"{protocol}:// needs the {package} package: pip install {package}{also}"
    return None


def run_path(location: str | RunPath) -> RunPath:
    """The path object of ``location``: a :class:`Path` for a local path or ``file://`` URL,
    a :class:`UPath` for another URL. A URL whose filesystem is not installed, or an unknown
    protocol, is a :class:`ConfigError`."""
    if isinstance(location, (Path, UPath)):
        return location
    text = str(location)
    protocol = protocol_of(text)
    if protocol is None:
        return Path(text)
    if protocol in _LOCAL_PROTOCOLS:
        return Path(fsspec.core.split_protocol(text)[1])
    problem = url_problem(text)
    if problem is not None:
        raise ConfigError(f"{text}: {problem}")
    return UPath(text)


def hydra_sweep_dir(run_dir: str) -> str:
    """``hydra.sweep.dir`` of a multirun: ``run.dir`` itself, or for a URL a local directory
    under the temporary directory. Hydra makes the directory before a job starts, and one
    named after the URL would be a local ``gs:/...``; the jobs themselves write to
    ``<run.dir>/<job number>`` (``tpu_train.trainer.setup.resolve_run_dir``)."""
    if not is_url(run_dir):
        return run_dir
    import getpass

    return str(Path(tempfile.gettempdir()) / f"tpu-train-sweeps-{getpass.getuser()}")


def is_local(path: RunPath) -> bool:
    """True for a path on this host's filesystems (a :class:`Path`)."""
    return not isinstance(path, UPath)


def remove_tree(path: RunPath) -> None:
    """Delete directory ``path`` and everything under it; nothing there is no error."""
    if is_local(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    with contextlib.suppress(FileNotFoundError):
        if path.exists():
            path.fs.rm(path.path, recursive=True)


def move_tree(source: RunPath, target: RunPath) -> None:
    """Move directory ``source`` to ``target`` (a rename locally, a copy and delete on an
    object store)."""
    if is_local(source):
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(source, target)
    else:
        source.fs.mv(source.path, target.path, recursive=True)


def modified_time(path: RunPath) -> float:
    """When the file ``path`` was last written (seconds since the epoch)."""
    if is_local(path):
        return path.stat().st_mtime
    return path.fs.modified(path.path).timestamp()


def upload(local: Path, target: RunPath) -> None:
    """Copy the local file or directory ``local`` to ``target`` (a local copy for a local
    target)."""
    if is_local(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        if local.is_dir():
            shutil.copytree(local, target, dirs_exist_ok=True)
        else:
            shutil.copyfile(local, target)
    elif local.is_dir():
        for file in sorted(p for p in local.rglob("*") if p.is_file()):
            target.fs.put_file(str(file), (target / file.relative_to(local).as_posix()).path)
    else:
        target.fs.put_file(str(local), target.path)


@contextlib.contextmanager
def local_file(path: RunPath) -> Iterator[Path]:
    """A local path holding the file ``path`` (itself when local; else a temporary download,
    removed afterwards), for readers that take a local path only (safetensors)."""
    if is_local(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="tpu-train-download-") as staging:
        local = Path(staging) / path.name
        path.fs.get_file(path.path, str(local))
        yield local


@contextlib.contextmanager
def staged_directory(target: RunPath) -> Iterator[Path]:
    """A local directory to write ``target``'s files into: ``target`` itself when local;
    else a temporary directory uploaded to ``target`` when the block ends without an error."""
    if is_local(target):
        yield target
        return
    with tempfile.TemporaryDirectory(prefix="tpu-train-stage-") as staging:
        yield Path(staging)
        upload(Path(staging), target)


class LocalMirror:
    """The local directory a run's logs are written in. For a local run directory it is the
    run directory itself; for a URL, a temporary directory whose files :meth:`sync` uploads
    (whole: object stores have no append). Files the URL already holds (a resumed run's log)
    are downloaded first so that the run appends to them."""

    def __init__(self, run_dir: RunPath, names: tuple[str, ...]):
        self.target = run_dir
        self._last_sync = time.monotonic()
        if is_local(run_dir):
            self.local, self._staging = run_dir, None
            run_dir.mkdir(parents=True, exist_ok=True)
            return
        self._staging = tempfile.TemporaryDirectory(prefix="tpu-train-logs-")
        self.local = Path(self._staging.name)
        for name in names:
            source = run_dir / name
            if source.is_file():
                source.fs.get_file(source.path, str(self.local / name))

    def due(self, force: bool = True) -> bool:
        """Whether :meth:`sync` has something to do: never for a local run directory; with
        ``force`` always, else once the last upload is :data:`SYNC_INTERVAL_S` old."""
        return self._staging is not None and (
            force or time.monotonic() - self._last_sync >= SYNC_INTERVAL_S)

    def sync(self) -> None:
        """Upload the local files to the run directory (for a URL)."""
        if self._staging is None:
            return
        upload(self.local, self.target)
        self._last_sync = time.monotonic()

    def close(self) -> None:
        """Upload the files a last time and remove the local copies."""
        if self._staging is None:
            return
        try:
            self.sync()
        finally:
            self._staging.cleanup()
            self._staging = None
