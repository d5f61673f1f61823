"""PyTorch's OpInfo database on the tpu device, checked against CPU PyTorch.

One test per op_db entry (``name`` or ``name.variant``), forward in float32 on the first
``CI_SAMPLES`` samples. ``opinfo_known_failures/<platform>.json`` lists the entries known to fail
on the test platform (``TPU_TRAIN_PLATFORM``); the check goes both ways:

* an entry that fails and is not listed fails its test (a regression: the error is shown);
* a listed entry that now passes fails its test too, asking to take it off the list.

The forward check also runs in fused eager mode (every 16th entry by default, all with
``-m slow``). The gradient sweep runs the same way but is marked ``slow`` (``pytest -m slow``). Refresh the
list with ``python scripts/op_coverage.py --grad --write-known-failures`` on that platform
(docs/op_coverage.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import tpu_train
from tests.ops import opinfo_harness as harness
from tests.platforms import PLATFORM

KNOWN_FAILURES_NAME = f"opinfo_known_failures/{PLATFORM}.json"
KNOWN_FAILURES_PATH = Path(__file__).parent / KNOWN_FAILURES_NAME
if not KNOWN_FAILURES_PATH.exists():
    raise FileNotFoundError(
        f"no OpInfo known-failure list for the {PLATFORM} platform: write it there with "
        f"TPU_TRAIN_PLATFORM={PLATFORM} python scripts/op_coverage.py --samples 1 --grad "
        f"--write-known-failures (docs/op_coverage.md)")
KNOWN = json.loads(KNOWN_FAILURES_PATH.read_text())
ALL_OPS = harness.all_ops()
ALL_KEYS = [harness.op_key(op) for op in ALL_OPS]
PART_ENV = "TPU_TRAIN_OPINFO_PART"


def _part(count: int) -> range:
    """The entries checked: all, or with TPU_TRAIN_OPINFO_PART=K/N the K-th of N equal slices
    (as ``scripts/op_coverage.py --part``), for a host that limits how long one command runs."""
    value = os.environ.get(PART_ENV, "").strip()
    if not value:
        return range(count)
    k, _, n = value.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"{PART_ENV}={value!r}: give K/N with 1 <= K <= N, e.g. 3/4")
    k, n = int(k), int(n)
    return range((k - 1) * count // n, k * count // n)


INDICES = _part(len(ALL_OPS))
OPS = [ALL_OPS[i] for i in INDICES]
KEYS = [ALL_KEYS[i] for i in INDICES]
# The list is only valid for the number of samples it was produced with.
CI_SAMPLES = KNOWN["samples"]


def _check(op, known: set, grad: bool) -> None:
    result = harness.run_op(op, torch.float32, samples=CI_SAMPLES, grad=grad)
    what = "gradient" if grad else "forward"
    listed = result.op in known
    if result.status == "skip":
        if listed:
            pytest.fail(f"{result.op} is listed as a known {what} failure but OpInfo has nothing "
                        f"to test ({result.error}): remove it from {KNOWN_FAILURES_NAME}")
        pytest.skip(result.error)
    if result.status == "fail" and not listed:
        pytest.fail(f"{result.op} ({what}, float32) fails on the tpu device and is not a known "
                    f"failure: {result.error}", pytrace=False)
    if result.status == "pass" and listed:
        pytest.fail(f"{result.op} ({what}, float32) now passes: remove it from the "
                    f"{what!r} list in {KNOWN_FAILURES_NAME}", pytrace=False)


@pytest.mark.parametrize("op", OPS, ids=KEYS)
def test_forward_float32(op):
    _check(op, set(KNOWN["forward"]), grad=False)


# Fused eager mode on the same list: every FUSED_STRIDE-th entry in the default run, the
# whole sweep with ``-m slow`` (``scripts/op_coverage.py --eager-mode fused`` gives the figures).
FUSED_STRIDE = 16
FUSED_PARAMS = [pytest.param(ALL_OPS[i], id=ALL_KEYS[i],
                             marks=() if i % FUSED_STRIDE == 0 else pytest.mark.slow)
                for i in INDICES]


@pytest.mark.parametrize("op", FUSED_PARAMS)
def test_forward_float32_fused_mode(op):
    with tpu_train.eager_mode("fused"):
        _check(op, set(KNOWN["forward"]), grad=False)


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS, ids=KEYS)
def test_grad_float32(op):
    _check(op, set(KNOWN.get("grad", ())), grad=True)


def test_known_failures_name_op_db_entries():
    keys = set(ALL_KEYS)
    for what in ("forward", "grad"):
        listed = KNOWN.get(what, [])
        stale = sorted(set(listed) - keys)
        assert not stale, f"{KNOWN_FAILURES_NAME}[{what!r}] names entries not in op_db: {stale}"
        assert listed == sorted(set(listed)), f"{what!r} list is not sorted and unique"
