"""The platform the tests run on, and what differs there (tests/conftest.py sets the default)."""

from __future__ import annotations

import os
import re

# TPU_TRAIN_PLATFORM as tpu_train reads it; tests/conftest.py makes it cpu when unset.
PLATFORM = os.environ.get("TPU_TRAIN_PLATFORM", "").strip().lower() or "cpu"

# What a TPU runtime (libtpu, through absl logging) writes to stderr when it starts: absl's
# "before InitializeLog" notice and glog-style lines ("I1204 10:11:12.345678  1234 file.cc:56]
# ...", or "I0000 00:00:1733300000.123456 ..." before the log is initialised: epoch seconds).
_RUNTIME_START_UP_LINE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|[IWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\])")


# The warning ``import jax`` gives on a TPU v5e (and newer) host whose kernel has transparent
# hugepages off (jax._src.cloud_tpu_init), as Python's warnings module writes it: the location
# and message, then the source line of the ``warnings.warn(`` call.
_HUGEPAGES_WARNING = re.compile(
    r"^\S*jax[/\\]_src[/\\]cloud_tpu_init\.py:\d+: UserWarning: Transparent hugepages are not "
    r"enabled\.")
_WARN_SOURCE_LINE = re.compile(r"^\s+warnings\.warn\($")


def without_runtime_start_up(stderr: str) -> str:
    """``stderr`` less the lines a TPU runtime writes as it starts, and JAX's start-up warning
    about transparent hugepages on a TPU host (on the cpu platform, unchanged: there the CPU
    client writes none, and any such line is worth a failure)."""
    if PLATFORM == "cpu":
        return stderr
    kept, after_warning = [], False
    for line in stderr.splitlines(keepends=True):
        if _HUGEPAGES_WARNING.match(line):
            after_warning = True
            continue
        if after_warning and _WARN_SOURCE_LINE.match(line.rstrip("\n")):
            after_warning = False
            continue
        after_warning = False
        if not _RUNTIME_START_UP_LINE.match(line):
            kept.append(line)
    return "".join(kept)


def python_path(*first) -> str:
    """A PYTHONPATH for a child process: ``first`` (the repository root, ...) ahead of the
    environment's own, which it keeps (a host may find torch or jax through it)."""
    return os.pathsep.join(str(p) for p in (*first, os.environ.get("PYTHONPATH", "")) if p)


def cpu_child_env(*path_first, **variables: str) -> dict[str, str]:
    """The environment for a child process that does not need the test platform's device: this
    process's, on the cpu platform. One process at a time can hold a TPU chip, and on a TPU host
    the test process holds it, so a child that inherited ``TPU_TRAIN_PLATFORM=tpu`` would fail
    to open it ("JAX finds no tpu devices"); ``TPU_TRAIN_PLATFORM=cpu`` keeps JAX's backends to
    the CPU (tpu_train.device.runtime). ``path_first``: ahead of PYTHONPATH (:func:`python_path`)
    where given; ``variables``: set as well. On the cpu platform the child runs as before."""
    env = dict(os.environ, TPU_TRAIN_PLATFORM="cpu", **variables)
    if path_first:
        env["PYTHONPATH"] = python_path(*path_first)
    return env
