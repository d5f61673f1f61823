"""Where a test session's time goes in XLA compiles: a pytest plugin, on when
``TPU_TRAIN_TEST_COMPILE_REPORT`` names a file (``tests/conftest.py`` loads it then).

For each test it counts the backend compiles JAX reports (``jax.monitoring``'s
``/jax/core/compile/backend_compile_duration``: XLA's own compile, not tracing or lowering, or
the read of the executable from the persistent cache where it was there: JAX times both) and
their seconds, beside the test's wall time (setup, call and teardown); ``cache_hits`` says how
many of the session's were reads, and the programs with the most compile seconds are listed by
name (a primitive JAX ran op by op is named after it: ``reshape``). At the session's end it
writes one JSON object to that file: the totals, the sums per test file, and the tests with the
most compile seconds. What a chip's lane spends compiling, and in which files, is then a
measurement rather than a guess (docs/testing.md)::

    TPU_TRAIN_TEST_COMPILE_REPORT=/tmp/compiles.json .ci/tpu_lane.sh

With pytest-xdist each worker writes ``<file>.<worker id>``. The file is also written every
:data:`WRITE_EVERY_S` seconds as tests finish, so that a session cut short (a host's limit on
one command) leaves what it had measured.
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

ENV = "TPU_TRAIN_TEST_COMPILE_REPORT"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
TOP_TESTS = 40
WRITE_EVERY_S = 10.0


class CompileReport:
    """The pytest plugin: per-test compile counts and seconds, written at the session end."""

    def __init__(self, path: Path):
        self.path = path
        self.compiles = 0
        self.compile_s = 0.0
        self.cache_hits = 0
        self.tests: dict[str, dict] = {}
        # Per compiled function's name: JAX names a primitive run op by op after the primitive
        # ("reshape", "convert_element_type"), a jitted function after the function.
        self.programs: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        self._start: tuple[float, int, float] | None = None
        self._written = time.perf_counter()
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(self._on_event)
        monitoring.register_event_listener(self._on_hit)

    def _on_hit(self, event: str, **_) -> None:
        if event == _HIT_EVENT:
            self.cache_hits += 1

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == _COMPILE_EVENT:
            self.compiles += 1
            self.compile_s += duration
            row = self.programs[str(kwargs.get("fun_name", "?"))]
            row[0] += 1
            row[1] += duration

    def pytest_runtest_logstart(self, nodeid, location):
        self._start = (time.perf_counter(), self.compiles, self.compile_s)

    def pytest_runtest_logfinish(self, nodeid, location):
        if self._start is None:
            return
        started, compiles, compile_s = self._start
        self.tests[nodeid] = {"wall_s": round(time.perf_counter() - started, 3),
                              "compiles": self.compiles - compiles,
                              "compile_s": round(self.compile_s - compile_s, 3)}
        self._start = None
        if time.perf_counter() - self._written >= WRITE_EVERY_S:
            self._write()

    def pytest_sessionfinish(self, session):
        self._write()

    def _write(self) -> None:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        path = self.path.with_name(f"{self.path.name}.{worker}") if worker else self.path
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.summary()))
        partial.replace(path)  # whole or not at all, for a reader while the session runs
        self._written = time.perf_counter()

    def summary(self) -> dict:
        files: dict[str, dict] = collections.defaultdict(
            lambda: {"tests": 0, "wall_s": 0.0, "compiles": 0, "compile_s": 0.0})
        for nodeid, figures in self.tests.items():
            row = files[nodeid.split("::")[0]]
            row["tests"] += 1
            for key in ("wall_s", "compiles", "compile_s"):
                row[key] += figures[key]
        by_compile = sorted(self.tests.items(), key=lambda kv: -kv[1]["compile_s"])
        programs = sorted(self.programs.items(), key=lambda kv: -kv[1][1])
        return {
            "tests": len(self.tests),
            "wall_s": round(sum(f["wall_s"] for f in self.tests.values()), 1),
            "compiles": self.compiles,
            "compile_s": round(self.compile_s, 1),
            "cache_hits": self.cache_hits,
            "files": {name: {k: round(v, 1) if isinstance(v, float) else v
                             for k, v in row.items()}
                      for name, row in sorted(files.items(), key=lambda kv: -kv[1]["wall_s"])},
            "top_tests_by_compile_s": dict(by_compile[:TOP_TESTS]),
            "top_programs_by_compile_s": {name: {"compiles": n, "compile_s": round(s, 1)}
                                          for name, (n, s) in programs[:TOP_TESTS]},
        }
