#!/usr/bin/env bash
# The parallel tests too long for the default run (marked slow): 4 processes x 2 virtual
# devices against the one-process losses. Prints pytest's result line, the test's duration
# and the machine load; docs/parallelism.md quotes the last result.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
timeout 900 "$PYTHON" -m pytest -q -p no:cacheprovider -m slow --durations=5 \
    tests/parallel/test_multiprocess_spmd.py "$@"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
