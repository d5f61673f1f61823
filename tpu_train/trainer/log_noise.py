"""Third-party log noise, off unless ``logging.verbose=true``.

A run's console is the run's own lines; what the libraries under it print by default (XLA's C++
warnings such as the coordination service's at ``jax.distributed`` start-up, jax/absl, Hugging
Face ``transformers``/``datasets`` and hydra warnings) says nothing a user can act on and buries
those lines, all the more with one copy per process. Errors still come through.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
import warnings

# Python loggers of the libraries whose warnings are noise in a run (errors still show).
QUIET_LOGGERS = ("jax", "jaxlib", "absl", "transformers", "datasets", "hydra", "filelock",
                 "fsspec", "urllib3")
# Warnings raised from these packages (``warnings.warn``), matched on the warning's module.
_QUIET_WARNING_MODULES = r"(jax|jaxlib|absl|transformers|datasets|hydra|omegaconf)(\..*)?$"
# Read by the libraries themselves, some only when they start (set before they do): XLA's C++
# log threshold (2: errors only) and the Hugging Face libraries' verbosity.
ABSL_ERRORS_ONLY = 2  # absl's C++ severities: 0 info, 1 warning, 2 error
QUIET_ENVIRONMENT = {"TF_CPP_MIN_LOG_LEVEL": "2", "TRANSFORMERS_VERBOSITY": "error",
                     "DATASETS_VERBOSITY": "error"}


def quiet_third_party_logs(verbose: bool) -> None:
    """Silence the libraries' warnings and info logs (``verbose=False``); with ``verbose=True``
    leave everything as the libraries set it. A variable the user set keeps its value."""
    if verbose:
        return
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if os.environ["TF_CPP_MIN_LOG_LEVEL"] == QUIET_ENVIRONMENT["TF_CPP_MIN_LOG_LEVEL"]:
        # jaxlib read the variable when it was imported (before any run setting is known):
        # its C++ threshold is set directly, as jax's own jax_logging_level option does.
        try:
            from jax._src.lib import utils

            utils.absl_set_min_log_level(ABSL_ERRORS_ONLY)
        except (ImportError, AttributeError):  # another jaxlib: the variable alone
            pass
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.level, logging.ERROR))
    warnings.filterwarnings("ignore", module=_QUIET_WARNING_MODULES)


# What Gloo prints on stdout (unconditionally, from C++) each time a group connects, one line
# per rank: torch's at every sharded checkpoint, jax's CPU collectives once per device. The
# ranks of one process print from several threads at once, so their lines arrive woven into
# each other in pieces ("[Gloo] Rank 3[Gloo] Rank 2 is connected to 7 ..."): the filter removes
# the pieces and drops a line left with nothing but their numbers.
GLOO_CONNECTED = re.compile(rb"\[Gloo\] Rank | is connected to | peer ranks\. ?|"
                            rb"Expected number of connected peer ranks is : ")
_LEFT_OF_A_GLOO_LINE = b" \t\r0123456789"


def without_gloo_pieces(line: bytes, pattern: re.Pattern = GLOO_CONNECTED) -> bytes | None:
    """``line`` without the pieces of Gloo's connection lines; None when nothing else is left."""
    kept, removed = pattern.subn(b"", line)
    if not removed:
        return line
    return None if not kept.strip(_LEFT_OF_A_GLOO_LINE) else kept


class StdoutLineFilter:
    """Takes the pieces ``pattern`` matches out of every line written to file descriptor 1,
    Python's and C++'s alike, and drops lines left empty (:func:`without_gloo_pieces`): fd 1
    becomes a pipe that a thread copies to the real stdout.

    :meth:`close` (also run at exit) restores fd 1 and copies what is left; a process ended by
    ``os._exit`` may lose the lines still in the pipe."""

    def __init__(self, pattern: re.Pattern):
        self.pattern = pattern
        sys.stdout.flush()
        self._stdout = os.dup(1)
        self._read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
        self._thread = threading.Thread(target=self._copy, name="stdout-line-filter",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _copy(self) -> None:
        pending = b""
        while True:
            chunk = os.read(self._read, 1 << 16)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = [without_gloo_pieces(line, self.pattern) for line in lines]
            self._write(b"".join(line + b"\n" for line in kept if line is not None))
        self._write(pending)
        os.close(self._read)

    def _write(self, data: bytes) -> None:
        while data:
            data = data[os.write(self._stdout, data):]

    def close(self) -> None:
        if self._stdout is None:
            return
        sys.stdout.flush()
        os.dup2(self._stdout, 1)  # the pipe's last write end closes: the thread sees its end
        self._thread.join(timeout=5)
        os.close(self._stdout)
        self._stdout = None


def quiet_process_group_noise(world_size: int, verbose: bool) -> StdoutLineFilter | None:
    """In a job of several processes, Gloo's connection lines off stdout (unless verbose)."""
    if verbose or world_size < 2:
        return None
    return StdoutLineFilter(GLOO_CONNECTED)
