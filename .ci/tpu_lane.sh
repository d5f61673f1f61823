#!/usr/bin/env bash
# The TPU lane of the test suite (docs/testing.md), on a host with a TPU chip: the tests of the
# device, ops, compile, models and trainer layers on the chip, in one process (one process at a
# time can hold a chip), less the tests that start several processes talking over 127.0.0.1.
#   .ci/tpu_lane.sh                       the whole lane
#   .ci/tpu_lane.sh tests/device -x       arguments replace the test paths (pytest's own options too)
# Not part of CI, which has no TPU: the CPU suite is .ci/run. PYTHON names the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
export TPU_TRAIN_PLATFORM=tpu
# TPU_TRAIN_PLATFORM chooses JAX's backends, here and in the child processes tests start.
unset JAX_PLATFORMS
# Tests run each program a few times, so its compile is what counts: XLA's least optimization
# effort compiled W1's step on the chip in 9.9 s instead of 32.5 and the default job's decoding
# program in 9.9 s instead of 12.9, at up to 2.4x the device time (docs/compile.md).
export JAX_EXEC_TIME_OPTIMIZATION_EFFORT="${JAX_EXEC_TIME_OPTIMIZATION_EFFORT:--1}"
# The compilation cache outlives the run (tests/conftest.py): a second run reads back the
# programs of the first, ~2 ms each on a v5e where compiling them took ~45-70 ms, and about half
# of a cold lane is XLA compile (docs/benchmarks.md). A fresh directory gives a cold run.
export TPU_TRAIN_TEST_CACHE_DIR="${TPU_TRAIN_TEST_CACHE_DIR:-$HOME/.cache/tpu_train/test_xla}"
if [[ ! -f tests/measured_ulps/tpu.json ]]; then
    echo "tests/measured_ulps/tpu.json is missing: measure the chip's accuracy first with" \
         "TPU_TRAIN_PLATFORM=tpu ${PYTHON:-python} scripts/measure_ulps.py --out tests/measured_ulps/tpu.json" >&2
    exit 2
fi
if [[ $# -eq 0 ]]; then
    set -- tests/device tests/ops tests/compile tests/models tests/trainer
fi
# pytest runs in a process group of its own, and a TERM or INT to this script (a `timeout` that
# cuts the lane short) ends the whole group: a child process a test started must not live on
# holding the chip, or the next process to open it finds it taken.
set -m
"${PYTHON:-python}" -m pytest -o addopts="" -n 0 -p no:cacheprovider -m "not slow and not multiprocess" \
    -rfEs "$@" &
lane=$!
trap 'kill -TERM -- "-$lane" 2>/dev/null; wait "$lane"; exit 143' TERM INT
wait "$lane"
