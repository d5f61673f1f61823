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


def without_runtime_start_up(stderr: str) -> str:
    """``stderr`` less the lines a TPU runtime writes as it starts (on the cpu platform, unchanged:
    there the CPU client writes none, and any such line is worth a failure)."""
    if PLATFORM == "cpu":
        return stderr
    return "".join(line for line in stderr.splitlines(keepends=True)
                   if not _RUNTIME_START_UP_LINE.match(line))
