"""Test-session setup (before JAX is imported anywhere): 8 virtual CPU devices, no persistent
compilation cache (on a chip: one for the session only; ``TPU_TRAIN_TEST_CACHE_DIR=<dir>``: one
kept there across sessions), and how many pytest-xdist workers ``-n auto`` (in ``addopts``)
starts.

``TPU_TRAIN_CACHE_DIR=off`` for the session and the ``tpu-train`` child processes it starts
(they inherit it): tests never write to the user's ``~/.cache/tpu_train/xla``, and a program is
always compiled, so "compiled the train step" / "XLA compile" in the logs that tests read does
not depend on test order or on whether an earlier compile happened to take over a second (the
cache's threshold). A session temporary cache was not measurably faster beyond the machine's load
noise (docs/compile.md): most test programs compile in under a second and are never written.
``tests/compile/test_persistent_cache.py`` gives its child processes a cache directory of their
own.

``TPU_TRAIN_PLATFORM`` names the platform the tests run on (``cpu`` unless set; ``tpu`` on a TPU
host, one process: ``-n 0``). Markers say what a test needs beyond one device, and
``pytest_runtest_setup`` skips it, with the reason, where the platform cannot give it
(docs/testing.md):

* ``devices(n)``: n devices of the test platform (the CPU client has 8 virtual ones);
* ``device_in_child``: starts a child process that opens the test platform's device; one
  process at a time can hold a TPU chip, and this one holds it;
* ``host_without_chips``: a host with no TPU chips, which a TPU host is not;
* ``host_cpu_run``: its runs train on the host CPU (``trainer.device=cpu``) and nothing else, the
  same computation whatever the test platform: skipped off the CPU platform, where the CPU
  suite has run it (the chip's lane keeps its minutes for what the chip computes);
* ``multiprocess``: several processes talking over 127.0.0.1, or the loopback sockets they meet
  on (deselect: ``-m "not multiprocess"``, where there is no network or only one chip).
"""

import os
import sys

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TPU_TRAIN_PLATFORM", "cpu")
# TPU_TRAIN_PLATFORM chooses JAX's backends; a JAX_PLATFORMS from the shell would override that
# choice here and in every child process, and a child asking for cpu would then start the TPU
# backend too, on the chip this process holds ("JAX finds no cpu devices").
os.environ.pop("JAX_PLATFORMS", None)
os.environ["TPU_TRAIN_CACHE_DIR"] = "off"
_KEPT_CACHE = os.environ.get("TPU_TRAIN_TEST_CACHE_DIR", "").strip()
if _KEPT_CACHE:
    # A cache that outlives the session (`.ci/tpu_lane.sh` keeps one by default): a later run
    # reads back what this one compiled, ~2 ms a program instead of ~45-70 ms on a v5e.
    # ``off`` means none at all; the value is checked where the runtime configures the cache.
    os.environ["TPU_TRAIN_CACHE_DIR"] = _KEPT_CACHE
elif os.environ["TPU_TRAIN_PLATFORM"].strip().lower() not in ("", "cpu"):
    # On a chip a trainer test's programs take 5-30 s of XLA compile each (docs/benchmarks.md),
    # and many tests build the same ones (the bundled model at the same settings): a cache
    # shared by this session only, in a directory removed at its end, compiles each once. A
    # TPU keeps every program (compilation_cache.min_compile_time_s): with that, 13 % of the
    # CPU suite's programs were read back rather than compiled, and tests that read a compile
    # log or count compiles accept a program from the cache.
    import atexit
    import shutil
    import tempfile

    _SESSION_CACHE = tempfile.mkdtemp(prefix="tpu_train_test_xla_")
    atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)
    os.environ["TPU_TRAIN_CACHE_DIR"] = _SESSION_CACHE
# Every op checks each tensor argument's cached key part against its geometry (op_cache).
os.environ.setdefault("TPU_TRAIN_VERIFY_KEY_PARTS", "1")

from tests.platforms import PLATFORM  # noqa: E402  (reads the environment above)

MAX_WORKERS = 4


def pytest_configure(config):
    """``TPU_TRAIN_TEST_COMPILE_REPORT=<file>``: per-test XLA compile counts and seconds
    written there at the end (tests/compile_report.py). A kept cache directory that cannot be
    one is a one-line usage error here, not an error in every test that starts the device."""
    _check_kept_cache()
    from tests import compile_report

    path = os.environ.get(compile_report.ENV)
    if path:
        from pathlib import Path

        config.pluginmanager.register(compile_report.CompileReport(Path(path)),
                                      "tpu_train_compile_report")


def _check_kept_cache() -> None:
    from pathlib import Path

    from tpu_train.device.compilation_cache import OFF_VALUES

    if not _KEPT_CACHE or _KEPT_CACHE.lower() in OFF_VALUES:
        return

    path = Path(_KEPT_CACHE).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        usable = path.is_dir() and os.access(path, os.W_OK)
    except OSError:
        usable = False
    if not usable:
        raise pytest.UsageError(f"TPU_TRAIN_TEST_CACHE_DIR={_KEPT_CACHE!r} is not a writable "
                                "directory: name one (it is created if missing), or 'off'")


def pytest_xdist_auto_num_workers(config):
    """One worker per core, at most four. Most tests are one Python thread (op sweeps, tracing,
    XLA compiles), so two workers on a 2-core machine run the suite in about 23 minutes instead
    of 38 (docs/benchmarks.md). Each worker keeps its compiled programs for the session (files
    stay on one worker: ``--dist loadfile``) and reaches 6-7 GB resident by the end, and the
    multi-process tests start up to four processes of their own: beyond four workers memory, not
    cores, is what runs out. ``-n 0`` runs everything in one process."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def pytest_collection_modifyitems(config, items):
    """Files with multi-process tests run first. With ``--dist loadfile`` a file stays on one
    worker, and those files are the suite's longest (one holds ~7 minutes of torchrun launches):
    handed out last, one of them kept a worker busy for minutes after the other had finished.
    First, the many short files fill in behind them and both workers end together.
    ``--no-loadscope-reorder`` in ``addopts`` keeps pytest-xdist from re-sorting the files by
    test count."""
    heavy = {item.path for item in items if item.get_closest_marker("multiprocess")}
    items.sort(key=lambda item: item.path not in heavy)  # stable: order within files is kept


def pytest_runtest_logreport(report):
    """Off the CPU platform (a chip's lane, which a host may cut short at its limit on one
    command), each failure is written to stderr as it happens: the summary at the end may
    never come."""
    if PLATFORM != "cpu" and report.failed:
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when}):\n"
                         f"{report.longreprtext[-3000:]}\n")


def _device_count() -> int:
    from tpu_train.device import runtime

    return runtime.device_count()


def pytest_runtest_setup(item):
    """Skips, with the reason, a test whose marker asks for what this platform cannot give."""
    wanted = item.get_closest_marker("devices")
    if wanted is not None:
        have = _device_count()
        if have < wanted.args[0]:
            pytest.skip(f"needs {wanted.args[0]} {PLATFORM} devices, this host has {have}: tpu:i "
                        f"are the devices of one platform (TPU_TRAIN_PLATFORM), so the CPU "
                        f"client's virtual devices cannot stand in")
    if PLATFORM != "cpu" and item.get_closest_marker("device_in_child"):
        pytest.skip(f"starts a child process on the {PLATFORM} device, which this process holds "
                    f"(one process at a time per chip)")
    if PLATFORM == "tpu" and item.get_closest_marker("host_without_chips"):
        pytest.skip("needs a host without TPU chips")
    if PLATFORM != "cpu" and item.get_closest_marker("host_cpu_run"):
        pytest.skip(f"trains on the host CPU only (trainer.device=cpu), as on any platform: the "
                    f"CPU suite runs it; the {PLATFORM} lane runs what the device computes")



@pytest.fixture(autouse=True)
def _tpu_matmul_precision_at_pytorchs_default():
    """A run in this process (an in-process ``tpu-train``, also one a shared fixture started)
    sets the process-wide float32 matmul precision of the tpu device from
    ``trainer.matmul_precision``; every test starts and ends at PyTorch's level, ``highest``."""
    from tpu_train.ops import matmul

    if matmul.get_matmul_precision() != "highest":
        matmul.set_matmul_precision("highest")
    yield
    if matmul.get_matmul_precision() != "highest":
        matmul.set_matmul_precision("highest")
