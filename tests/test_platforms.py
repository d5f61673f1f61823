"""What the tests filter out of a child's stderr on a TPU host (tests/platforms.py)."""

from __future__ import annotations

from tests import platforms

# As libtpu writes them when it starts (absl logging before InitializeLog, glog-style lines).
START_UP = ("WARNING: All log messages before absl::InitializeLog() is called are written to "
            "STDERR\n"
            "I0000 00:00:1733300000.123456   4242 tpu_initializer_helper.cc:123] libtpu.so "
            "found\n"
            "W1204 10:11:12.345678  4242 pjrt_api.cc:78] PJRT_Api already exists\n")
OWN = "tpu_train: a line of our own\nTraceback (most recent call last):\n"
# What ``import jax`` writes on a TPU v5e host whose kernel has transparent hugepages off.
HUGEPAGES = ("/opt/venv/lib/python3.11/site-packages/jax/_src/cloud_tpu_init.py:88: UserWarning: "
             "Transparent hugepages are not enabled. TPU runtime startup and shutdown time should "
             "be significantly improved on TPU v5e and newer.\n"
             "  warnings.warn(\n")


def test_a_tpu_runtimes_start_up_lines_are_dropped_and_nothing_else(monkeypatch):
    monkeypatch.setattr(platforms, "PLATFORM", "tpu")
    assert platforms.without_runtime_start_up(START_UP + OWN) == OWN
    assert platforms.without_runtime_start_up(START_UP) == ""


def test_jaxs_hugepages_warning_is_dropped_and_no_other_warning(monkeypatch):
    monkeypatch.setattr(platforms, "PLATFORM", "tpu")
    assert platforms.without_runtime_start_up(HUGEPAGES + START_UP + OWN) == OWN
    other = "x.py:3: UserWarning: something else\n  warnings.warn(\n"
    assert platforms.without_runtime_start_up(HUGEPAGES + other) == other


def test_nothing_is_filtered_on_cpu(monkeypatch):
    monkeypatch.setattr(platforms, "PLATFORM", "cpu")
    assert platforms.without_runtime_start_up(START_UP + OWN) == START_UP + OWN


def test_off_the_cpu_a_failure_is_written_as_it_happens(monkeypatch, capsys):
    """A chip's lane may be cut short before pytest's summary: tests/conftest.py writes each
    failure to stderr when it is reported (on the cpu platform the summary is enough)."""
    from types import SimpleNamespace

    from tests import conftest

    failed = SimpleNamespace(failed=True, nodeid="tests/x/test_y.py::test_z", when="call",
                             longreprtext="AssertionError: 2 != 1")
    passed = SimpleNamespace(failed=False, nodeid="tests/x/test_y.py::test_w", when="call",
                             longreprtext="")
    monkeypatch.setattr(conftest, "PLATFORM", "tpu")
    conftest.pytest_runtest_logreport(failed)
    conftest.pytest_runtest_logreport(passed)
    written = capsys.readouterr().err
    assert "FAILED tests/x/test_y.py::test_z (call):\nAssertionError: 2 != 1" in written
    assert "test_w" not in written
    monkeypatch.setattr(conftest, "PLATFORM", "cpu")
    conftest.pytest_runtest_logreport(failed)
    assert capsys.readouterr().err == ""
