"""scripts/launch_pod.sh: the gcloud commands it would run, and its argument errors."""

import shlex
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "launch_pod.sh"


def _run(*args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=30)


def test_dry_run_passes_one_run_id_and_coordinator_to_every_worker():
    proc = _run("--dry-run", "--zone", "us-central2-b", "--project", "proj", "--port", "9000",
                "--coordinator-ip", "10.1.2.3", "--num-workers", "4", "--run-id", "r-1",
                "--env", "HF_HOME=/mnt/hf", "--workdir", "/opt/app", "my-tpu",
                "tpu-train recipe=llama_finetune parallel.fsdp=-1")
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout.strip().splitlines()[-1])
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu"]
    assert "--worker=all" in argv
    assert argv[argv.index("--zone") + 1] == "us-central2-b"
    assert argv[argv.index("--project") + 1] == "proj"
    remote = argv[argv.index("--command") + 1]
    for piece in ("WORLD_SIZE=4", "MASTER_ADDR=10.1.2.3", "MASTER_PORT=9000", "LOCAL_RANK=0",
                  "TPU_TRAIN_JAX_COORDINATOR=10.1.2.3:9001", "TPU_TRAIN_RUN_ID=r-1",
                  "export HF_HOME=/mnt/hf", "cd /opt/app", "agent-worker-number",
                  "tpu-train recipe=llama_finetune parallel.fsdp=-1"):
        assert piece in remote, piece
    # The user's command runs last, after every variable is exported.
    assert remote.rstrip().endswith("parallel.fsdp=-1")


def test_dry_run_without_addresses_prints_the_lookup():
    proc = _run("--dry-run", "--zone", "europe-west4-a", "pod", "hostname")
    assert proc.returncode == 0, proc.stderr
    first = shlex.split(proc.stdout.splitlines()[0])
    assert first[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "pod"]
    assert "TPU_TRAIN_RUN_ID=" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (("pod",), "expected TPU_NAME and one quoted COMMAND"),
    (("--bogus", "pod", "cmd"), "unknown option --bogus"),
    (("--port", "x", "pod", "cmd"), "--port must be"),
    (("--env", "NOVALUE", "pod", "cmd"), "--env needs KEY=VALUE"),
    (("--run-id", "a b", "pod", "cmd"), "--run-id may hold only"),
])
def test_bad_arguments_fail_with_a_message(args, message):
    proc = _run("--dry-run", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
