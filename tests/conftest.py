"""Test-session setup (before JAX is imported anywhere): 8 virtual CPU devices, no persistent
compilation cache, and how many pytest-xdist workers ``-n auto`` (in ``addopts``) starts.

``TPU_TRAIN_CACHE_DIR=off`` for the session and the ``tpu-train`` child processes it starts
(they inherit it): tests never write to the user's ``~/.cache/tpu_train/xla``, and a program is
always compiled, so "compiled the train step" / "XLA compile" in the logs that tests read does
not depend on test order or on whether an earlier compile happened to take over a second (the
cache's threshold). A session temporary cache was not measurably faster beyond the machine's load
noise (docs/compile.md): most test programs compile in under a second and are never written. ``tests/compile/test_persistent_cache.py`` gives its child
processes a cache directory of their own.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TPU_TRAIN_PLATFORM", "cpu")
os.environ["TPU_TRAIN_CACHE_DIR"] = "off"
# Every op checks each tensor argument's cached key part against its geometry (op_cache).
os.environ.setdefault("TPU_TRAIN_VERIFY_KEY_PARTS", "1")

MAX_WORKERS = 4


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
