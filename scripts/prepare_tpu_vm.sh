#!/usr/bin/env bash
# Prepare one worker of a TPU VM slice for scripts/launch_pod.sh: Python 3.11 with venv (jax 0.10
# needs >= 3.11; the TPU VM images are Ubuntu 22.04, Python 3.10) and Cloud Storage FUSE with the
# bucket mounted where every worker sees it, the shared storage of the run directory. Run it on
# every worker at once (docs/tpu.md, "A pod"); a second run changes nothing.
#
#   bash prepare_tpu_vm.sh BUCKET [MOUNT_POINT]      (MOUNT_POINT default: /shared)
#
# The bucket is mounted with --implicit-dirs for the VM's login user, through the VM's service
# account (the slice needs a storage scope: --scopes=https://www.googleapis.com/auth/cloud-platform).
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || "$1" == -* ]]; then
  echo "usage: prepare_tpu_vm.sh BUCKET [MOUNT_POINT]   (the bucket's name, without gs://)" >&2
  exit 2
fi
bucket="${1#gs://}"
mount_point="${2:-/shared}"

packages=()
command -v python3.11 >/dev/null && python3.11 -c "import ensurepip" 2>/dev/null \
  || packages+=(python3.11 python3.11-venv)
if ! command -v gcsfuse >/dev/null; then
  # Cloud Storage FUSE comes from Google's apt repository, named after the Ubuntu release.
  curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg \
    | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
  echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-$(lsb_release -cs) main" \
    | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
  packages+=(gcsfuse)
fi
if [[ ${#packages[@]} -gt 0 ]]; then
  sudo apt-get update -q
  sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${packages[@]}"
fi

if mountpoint -q "$mount_point"; then
  echo "prepare_tpu_vm: $mount_point is already mounted"
else
  sudo mkdir -p "$mount_point"
  sudo chown "$(id -u):$(id -g)" "$mount_point"
  gcsfuse --implicit-dirs "$bucket" "$mount_point"
  echo "prepare_tpu_vm: gs://$bucket mounted at $mount_point"
fi
