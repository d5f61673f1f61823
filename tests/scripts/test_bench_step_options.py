"""scripts/bench_step_options.py refuses options that are not a JSON object, in one line."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_step_options.py"


@pytest.mark.parametrize("options, message", [("{xla: 1}", "--options is not JSON"),
                                              ("[1, 2]", "--options must be a JSON object")])
def test_bad_options_are_a_one_line_usage_error(options, message):
    result = subprocess.run([sys.executable, str(SCRIPT), "--options", options],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]
