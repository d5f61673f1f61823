"""A rank that dies or hangs makes the others fail within the timeout, naming it."""

import time

import pytest

from tests.distributed.harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]

TIMEOUT_S = 10


@pytest.mark.parametrize("mode,expected", [
    ("die", "lost rank(s) [1]"),
    ("hang", "rank(s) [1]"),
])
def test_survivors_fail_naming_the_lost_rank(mode, expected):
    start = time.monotonic()
    outputs = run_ranks(["tests/distributed/workers/failure_worker.py", mode, "1"], 3,
                        timeout=90, extra_env={"TPU_TRAIN_COLLECTIVE_TIMEOUT": str(TIMEOUT_S)})
    elapsed = time.monotonic() - start
    (code0, log0), _, (code2, log2) = outputs
    # the run ends by itself (no harness kill), well within start-up + timeout + diagnosis
    assert code0 is not None and code2 is not None, "a survivor hung until the harness killed it"
    assert elapsed < 80
    assert code0 != 0 and code2 != 0
    assert "finished" not in log0 + log2
    # both survivors name rank 1: rank 0 (the store host) keeps the store up until rank 2
    # has read the heartbeats it needs
    assert "CollectiveTimeoutError" in log0 and expected in log0, log0[-2000:]
    assert "CollectiveTimeoutError" in log2 and expected in log2, log2[-2000:]
