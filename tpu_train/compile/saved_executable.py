"""A compiled step written to a file, and loaded in place of XLA's compile.

A job that runs the same step on many hosts, or many times, need not compile it on each:
:func:`save` writes the executable XLA compiled (``jax.experimental.serialize_executable``)
and, beside it, a small JSON manifest (``PATH.json``) of what it was compiled for: the
versions of tpu_train (and its git commit, in a checkout), JAX, jaxlib and libtpu, the
platform, chip and device count, the mesh, the step's inputs and settings (its compile
signature), and a fingerprint of the lowered module. :func:`load` compares all of that with
the program it is to stand in for and only then deserializes: a mismatch is a one-line
:class:`ExecutableMismatchError` naming the first fact that differs.

Loading stands in for XLA's compile only: the step is still traced and lowered (the call
needs what tracing finds, and the lowered module's fingerprint is what is compared), so the
executable is the one that program's compile would have made, with the same shardings and
donation. A serialized executable is a pickle that may run code when loaded: load only
files you wrote.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import jax
import jaxlib

__all__ = ["CannotSaveError", "ExecutableMismatchError", "MANIFEST_SUFFIX", "environment", "fingerprint", "load",
           "manifest_path", "save", "signature_facts"]

MANIFEST_SUFFIX = ".json"
_FORMAT = 1


class ExecutableMismatchError(ValueError):
    """A saved executable that cannot stand in for this program (one line: what differs)."""


class CannotSaveError(ValueError):
    """An executable that cannot be written so that another process can load it."""


def manifest_path(path: str | os.PathLike) -> Path:
    """Where the manifest of the executable at ``path`` is written: ``PATH.json``."""
    path = Path(path)
    return path.with_name(path.name + MANIFEST_SUFFIX)


def fingerprint(lowered) -> str:
    """SHA-256 of the lowered module's text (no debug locations: the same program traced in
    another process, or from another working directory, gives the same text)."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _source_commit() -> str | None:
    """The git commit of a tpu_train checkout (None for an installed wheel, or without git)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        found = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                               capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None if found.returncode == 0 else None


def environment(devices, mesh_shape: dict | None) -> dict[str, Any]:
    """What an executable is tied to besides its program: software versions, the platform,
    the chip, how many devices run it and over which mesh axes."""
    first = devices[0]
    platform = first.platform
    return {"platform": platform, "device kind": str(first.device_kind),
            "devices": len(devices), "mesh": mesh_shape,
            "tpu_train": _package_version("tpu_train"), "tpu_train commit": _source_commit(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "libtpu": _package_version("libtpu") if platform == "tpu" else None}


def signature_facts(signature) -> dict[str, dict[str, str]]:
    """A compile signature (:class:`tpu_train.compile.cache.Signature`) as JSON: each input's
    shape and dtype, each setting's value. Placements and stored shapes are left out: they
    name this host's devices, and the fingerprint covers the layout."""
    return {"inputs": {spec.name: f"shape {tuple(spec.shape)} dtype {spec.dtype}"
                       for spec in signature.inputs},
            "settings": {name: repr(value) for name, value in signature.settings}}


def save(compiled, lowered, path: str | os.PathLike, *, environment_facts: dict,
         signature: dict) -> dict[str, Any]:
    """Write ``compiled`` (a ``jax.stages.Compiled`` of ``lowered``) to ``path`` and its
    manifest to ``PATH.json``; returns the manifest. Each file is written to a temporary name
    and renamed, so a reader never sees half of one."""
    from jax.experimental import serialize_executable

    started = time.perf_counter()
    blob, _, _ = serialize_executable.serialize(compiled)
    manifest = {"format": _FORMAT, "fingerprint": fingerprint(lowered),
                "environment": environment_facts, "signature": signature,
                "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                "serialize_s": time.perf_counter() - started}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, blob)
    _write_atomically(manifest_path(path), json.dumps(manifest, indent=1).encode())
    return manifest


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the executable at ``path`` (an :class:`ExecutableMismatchError` where
    either file is missing or the manifest unreadable)."""
    path = Path(path)
    if not path.is_file():
        raise ExecutableMismatchError(f"no saved executable at {path}")
    beside = manifest_path(path)
    try:
        manifest = json.loads(beside.read_text())
    except (OSError, ValueError) as error:
        raise ExecutableMismatchError(f"the saved executable {path} has no readable manifest "
                                      f"{beside} ({type(error).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise ExecutableMismatchError(f"{beside} is not a manifest of format {_FORMAT}")
    return manifest


def check_environment(path, manifest: dict, here: dict) -> None:
    """Raise :class:`ExecutableMismatchError` naming the first fact of ``here`` (this
    process, :func:`environment`) that differs from the manifest's. A tpu_train version or
    commit unknown on either side is not compared."""
    saved = manifest.get("environment", {})
    for key, value in here.items():
        theirs = saved.get(key)
        # A checkout run from PYTHONPATH has no installed version (and a copy of it no git
        # commit): unknown on either side is not compared; the lowered program's fingerprint,
        # checked after these, still tells another step apart.
        if key in ("tpu_train", "tpu_train commit") and (value is None or theirs is None):
            continue
        if theirs != value:
            raise ExecutableMismatchError(
                f"the saved executable {path} was compiled for {key} {_shown(theirs)}, this "
                f"job has {_shown(value)}")


def check_signature(path, manifest: dict, signature: dict) -> None:
    """Raise :class:`ExecutableMismatchError` naming the first input or setting of this
    step (:func:`signature_facts`) that differs from the manifest's."""
    saved = manifest.get("signature", {})
    for part in ("inputs", "settings"):
        theirs, ours = saved.get(part, {}), signature[part]
        for name, value in ours.items():
            if name not in theirs:
                raise ExecutableMismatchError(
                    f"the saved executable {path} was compiled for another step without "
                    f"{name} ({value} here)")
            if theirs[name] != value:
                what = "" if part == "inputs" else "setting "
                raise ExecutableMismatchError(
                    f"the saved executable {path} was compiled for another step: {what}{name} "
                    f"is {theirs[name]} there, {value} here")
        for name in theirs:
            if name not in ours:
                raise ExecutableMismatchError(
                    f"the saved executable {path} was compiled for another step, with "
                    f"{name} ({theirs[name]}), which this step has not")


def _shown(value) -> str:
    return "none" if value is None else str(value)


def load(path: str | os.PathLike, lowered, *, manifest: dict, devices: list | None = None):
    """The executable at ``path`` loaded for ``lowered`` (a ``jax.stages.Lowered``), after its
    fingerprint and bytes are checked against ``manifest`` (:func:`read_manifest`, whose
    environment and signature the caller checked). ``devices``: the devices it runs on
    (default: every device of the backend of ``devices[0]``, or JAX's default backend)."""
    from jax.experimental import serialize_executable

    if manifest.get("fingerprint") != fingerprint(lowered):
        raise ExecutableMismatchError(
            f"the saved executable {path} was compiled from another lowered program (same "
            "inputs and settings, other code: compile it again with this tpu_train)")
    blob = Path(path).read_bytes()
    if hashlib.sha256(blob).hexdigest() != manifest.get("sha256"):
        raise ExecutableMismatchError(f"the saved executable {path} is damaged (its SHA-256 "
                                      "differs from its manifest's); write it again")
    backend = devices[0].client if devices else None
    return serialize_executable.deserialize_and_load(blob, lowered.in_tree, lowered.out_tree,
                                                     backend=backend,
                                                     execution_devices=devices)
