"""Where a benchmark's figures come from: the checkout's commit, for the one JSON line each
script under ``scripts/`` prints (docs/benchmarks.md quotes figures with their commit)."""

from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit() -> str | None:
    """The checkout's commit, abbreviated, ``-dirty`` when files differ from it; None outside
    a git checkout (an unpacked copy of the scripts) or without git."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                              cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None
