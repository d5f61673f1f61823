"""tests/compile_report.py counts the XLA compiles of each test and writes the sums."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from tests import compile_report
from tests.compile_report import CompileReport


def test_counts_each_tests_compiles_and_writes_the_sums(tmp_path, monkeypatch):
    # Under pytest-xdist the report goes to "<file>.<worker id>"; this one is the plain file.
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    report = CompileReport(tmp_path / "compiles.json")
    x = jax.device_put(np.ones((7, 13), np.float32))
    report.pytest_runtest_logstart("tests/a/test_x.py::test_one", None)
    # Two programs never compiled before in this process (a shape of their own).
    def scaled(x):
        return x * 3 + 1

    jax.jit(scaled)(x).block_until_ready()
    jax.jit(lambda x: jnp.sin(x).sum())(x).block_until_ready()
    report.pytest_runtest_logfinish("tests/a/test_x.py::test_one", None)
    report.pytest_runtest_logstart("tests/a/test_x.py::test_two", None)
    report.pytest_runtest_logfinish("tests/a/test_x.py::test_two", None)
    report.pytest_sessionfinish(None)

    written = json.loads((tmp_path / "compiles.json").read_text())
    one = written["top_tests_by_compile_s"]["tests/a/test_x.py::test_one"]
    assert one["compiles"] == 2 and one["compile_s"] > 0
    assert written["top_tests_by_compile_s"]["tests/a/test_x.py::test_two"]["compiles"] == 0
    assert written["files"]["tests/a/test_x.py"]["tests"] == 2
    assert written["files"]["tests/a/test_x.py"]["compiles"] == 2
    assert written["cache_hits"] == 0  # programs new to the session: compiled, not read
    # By the compiled function's name, as JAX reports it.
    programs = written["top_programs_by_compile_s"]
    assert programs["jit(scaled)"]["compiles"] == 1
    assert sum(p["compiles"] for p in programs.values()) == 2


def test_a_pytest_xdist_worker_writes_a_file_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    CompileReport(tmp_path / "compiles.json").pytest_sessionfinish(None)
    assert [p.name for p in tmp_path.iterdir()] == ["compiles.json.gw3"]


def test_a_session_cut_short_leaves_what_it_measured(tmp_path, monkeypatch):
    """Written as tests finish, every WRITE_EVERY_S seconds, not only at the session's end."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(compile_report, "WRITE_EVERY_S", 0.0)
    report = CompileReport(tmp_path / "compiles.json")
    report.pytest_runtest_logstart("tests/a/test_x.py::test_one", None)
    report.pytest_runtest_logfinish("tests/a/test_x.py::test_one", None)
    written = json.loads((tmp_path / "compiles.json").read_text())  # no sessionfinish
    assert list(written["top_tests_by_compile_s"]) == ["tests/a/test_x.py::test_one"]
    assert [p.name for p in tmp_path.iterdir()] == ["compiles.json"]
