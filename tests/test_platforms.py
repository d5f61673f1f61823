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


def test_a_tpu_runtimes_start_up_lines_are_dropped_and_nothing_else(monkeypatch):
    monkeypatch.setattr(platforms, "PLATFORM", "tpu")
    assert platforms.without_runtime_start_up(START_UP + OWN) == OWN
    assert platforms.without_runtime_start_up(START_UP) == ""


def test_nothing_is_filtered_on_cpu(monkeypatch):
    monkeypatch.setattr(platforms, "PLATFORM", "cpu")
    assert platforms.without_runtime_start_up(START_UP + OWN) == START_UP + OWN
