"""Test-session setup: 8 virtual CPU devices (set before JAX is imported anywhere)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TPU_TRAIN_PLATFORM", "cpu")
