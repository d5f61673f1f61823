"""Errors raised by the data pipeline.

Every data error names the file (and, for record-level problems, the 1-based line number) so a
user can open the file at the offending line without re-running anything.
"""

from __future__ import annotations

from pathlib import Path


class DataError(ValueError):
    """Bad input data: a missing/empty file, a malformed record or a missing field.

    ``path`` and ``line`` (1-based, or ``None`` for file-level problems) are kept as attributes
    so callers can report or skip precisely.
    """

    def __init__(self, message: str, path: str | Path | None = None, line: int | None = None):
        location = ""
        if path is not None:
            location = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(location + message)
        self.path = None if path is None else str(path)
        self.line = line
