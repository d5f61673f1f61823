"""Shared by the bad-input suite: a run directory that must stay untouched, and the assertion
every case makes (exit 2, exactly one line on stderr, nothing written)."""

from __future__ import annotations

import pytest

from tests.trainer.cli_helpers import TINY, one_thread, run_in_process, snapshot  # noqa: F401

ERROR_PREFIX = "tpu-train: error: "


@pytest.fixture(scope="package")
def existing_run(tmp_path_factory):
    """A run directory holding a real checkpoint from a 1-step run: every case points at it,
    and none may change a byte of it."""
    run_dir = tmp_path_factory.mktemp("existing") / "run"
    code, _, err = run_in_process(*TINY, "trainer.max_steps=1", f"run.dir={run_dir}")
    assert code == 0, err
    return run_dir


def assert_one_line_error(code: int, out: str, err: str, expected: str) -> None:
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(ERROR_PREFIX), lines[0]
    assert expected in lines[0], lines[0]


def run_against(existing_run, *overrides: str) -> tuple[int, str, str]:
    """``tpu-train`` on the tiny settings, pointed at ``existing_run``, in this process."""
    return run_in_process(*TINY, "trainer.max_steps=2", f"run.dir={existing_run}", *overrides)
