"""Every collective of the tpu ProcessGroup against gloo's results on the same data."""

import json

import pytest

from tests.distributed.harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _results(outputs):
    found = []
    for code, log in outputs:
        line = next((l for l in log.splitlines() if l.startswith("RESULT ")), None)
        assert line is not None, f"a rank printed no result (exit {code}):\n{log[-3000:]}"
        found.append((code, json.loads(line[len("RESULT "):])))
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_matches_gloo(world):
    outputs = run_ranks(["tests/distributed/workers/collectives_worker.py"], world, timeout=240,
                        extra_env={"TPU_TRAIN_COLLECTIVE_TIMEOUT": "60"})
    for code, result in _results(outputs):
        assert result["failures"] == [], result
        assert result["checked"] >= 90  # every case ran, none was skipped silently
        assert code == 0
