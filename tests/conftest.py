"""Test-session setup (before JAX is imported anywhere): 8 virtual CPU devices, and JAX's
persistent compilation cache in a temporary directory of this session.

The cache directory is never the user's (``~/.cache/tpu_train/xla``): tests must not write to
the home directory, and a session starts cold, as CI does. Within the session, and in the
``tpu-train`` child processes it starts (they inherit the variable), a program compiled once
(in over a second) is loaded by the next test that builds it. ``TPU_TRAIN_CACHE_DIR=off`` in
the environment is kept (no persistent cache at all). The directory is removed at exit.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TPU_TRAIN_PLATFORM", "cpu")

if os.environ.get("TPU_TRAIN_CACHE_DIR", "").strip().lower() != "off":
    _cache_dir = tempfile.mkdtemp(prefix="tpu_train_test_xla_")
    os.environ["TPU_TRAIN_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, True)
