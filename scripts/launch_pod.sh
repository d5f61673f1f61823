#!/usr/bin/env bash
# Run one command on every worker (host) of a TPU VM slice, as one multi-host job: sync the
# checkout, set up a virtual environment once per worker, launch, log each worker, and stop
# every worker on Ctrl-C or when one fails.
#
#   scripts/launch_pod.sh [options] TPU_NAME "COMMAND ..."      (--help: every option)
#   scripts/launch_pod.sh --dry-run --num-workers 4 --coordinator-ip 10.0.0.2 my-tpu "tpu-train ..."
#
# The launcher is tpu_train/distributed/pod.py, run by path: it needs python3 (>= 3.10) and
# gcloud on this machine, not torch or JAX. Same as `python -m tpu_train.launch pod ...`.
exec "${PYTHON:-python3}" "$(dirname "$0")/../tpu_train/distributed/pod.py" "$@"
