"""Waiting for a process the test did not start itself (a grandchild) to end."""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_gone(pid: int, within: float = 20.0) -> bool:
    """Whether process ``pid`` ends within ``within`` seconds. A zombie counts as ended: a
    grandchild whose parent was killed waits there until whoever adopted it reaps it."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        stat = Path(f"/proc/{pid}/stat")
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (OSError, IndexError):
            pass  # no /proc, or ended meanwhile: the next kill(pid, 0) says which
        time.sleep(0.05)
    return False
