"""Test-session setup (before JAX is imported anywhere): 8 virtual CPU devices, and no
persistent compilation cache.

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
