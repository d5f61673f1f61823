"""Shared pytest markers."""

from __future__ import annotations

import os

import pytest

from tpu_train.compile import targets

# Tests that compile for a TPU with XLA's TPU compiler (libtpu, no chip needed). Skipped where
# libtpu is not installed, except under CI (CI=true), which installs the [tpu] extra: there a
# missing libtpu must fail these tests, not skip them.
needs_libtpu = pytest.mark.skipif(
    not targets.libtpu_available() and os.environ.get("CI") != "true",
    reason="libtpu (XLA's TPU compiler) is not installed: "
           'pip install -c constraints.txt -e ".[test,tpu]"')
