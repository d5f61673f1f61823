"""Every command of docs/tpu.md's pod and GKE sections, run as a dry run.

Each section's ```bash blocks run in order, as one bash script (``set -euo pipefail``), from a
directory that holds the checkout's files, so that the variables, quoting and redirections are
bash's own. What runs for real: this project's tools (``scripts/gke/render_jobset.py`` writes the
manifest; ``scripts/launch_pod.sh`` runs with ``--dry-run`` added, the one change made to the
text). What cannot run here (gcloud, kubectl, docker, xpk: they need a cloud project) is a
stand-in, ``fake_cli.py``, that checks each command line against ``cli_table.py``: the
subcommands and flags written from those tools' references (the gcloud ones checked against
Cloud SDK 528's ``--help``), and the files the command refers to. So this test finds a
misspelled subcommand or flag, a missing value, a script or file that does not exist, a
manifest that does not parse or lacks its volume, and steps that do not fit together (the
image pushed is the one the JobSet runs, the node pool has the slice's topology, the service
account given the bucket is the pods'); it cannot find a value the cloud would refuse.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import cli_table  # noqa: E402

SECTIONS = {"pod": "## A pod: every host of a TPU VM slice",
            "gke": "## GKE: a JobSet per TPU slice"}
TOOLS = ("gcloud", "kubectl", "docker", "xpk")


def bash_blocks(heading: str) -> list[str]:
    text = (REPO / "docs" / "tpu.md").read_text()
    start = text.index(heading + "\n")
    following = text.find("\n## ", start + len(heading))
    section = text[start:following if following != -1 else len(text)]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def run_section(name: str, tmp_path: Path):
    """Runs the section's blocks; returns the recorded tool calls, bash's stdout and the
    directory the commands ran in."""
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in {".git", ".venv"}:
            (work / entry.name).symlink_to(entry)
    for tool in TOOLS:
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{HERE / "fake_cli.py"}" {tool} "$@"\n')
        stub.chmod(0o755)
    script = "\n".join(bash_blocks(SECTIONS[name]))
    script = re.sub(r"scripts/launch_pod\.sh(?! --dry-run)", "scripts/launch_pod.sh --dry-run",
                    script)
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "FAKE_CLI_LOG": str(log), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name} section failed:\n{done.stderr}"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return calls, done.stdout, work


def only(calls, tool, *command):
    found = [c for c in calls if c["argv"][0] == tool and tuple(c["command"]) == command]
    assert len(found) == 1, f"expected one `{tool} {' '.join(command)}`, got {len(found)}"
    return found[0]


def test_every_section_has_commands():
    for heading in SECTIONS.values():
        assert bash_blocks(heading), heading


def test_pod_section_creates_the_slice_mounts_the_bucket_and_launches(tmp_path):
    calls, stdout, _ = run_section("pod", tmp_path)
    bucket = only(calls, "gcloud", "storage", "buckets", "create")["positionals"][0]
    slice_ = only(calls, "gcloud", "compute", "tpus", "queued-resources", "create")
    name = slice_["flags"]["--node-id"]
    assert slice_["positionals"] == [name]
    assert slice_["flags"]["--accelerator-type"] == "v5litepod-16"
    assert slice_["flags"]["--runtime-version"] == "v2-alpha-tpuv5-lite"  # the v5e image
    assert "cloud-platform" in slice_["flags"]["--scopes"]  # the hosts may use the bucket
    # The storage: the script copied to and run on every worker, with the bucket and /shared.
    scp = only(calls, "gcloud", "compute", "tpus", "tpu-vm", "scp")
    assert scp["positionals"] == ["scripts/prepare_tpu_vm.sh", f"{name}:"]
    ssh = only(calls, "gcloud", "compute", "tpus", "tpu-vm", "ssh")
    assert scp["flags"]["--worker"] == ssh["flags"]["--worker"] == "all"
    assert shlex.split(ssh["flags"]["--command"]) == [
        "bash", "prepare_tpu_vm.sh", bucket.removeprefix("gs://"), "/shared"]
    # The launcher's dry runs: their own gcloud commands fit the table too, and the run
    # directory is on the mount.
    launcher = [line for line in stdout.splitlines() if line.startswith("gcloud ")]
    assert launcher and all(f" {name}" in line for line in launcher)
    for line in launcher:
        cli_table.parse(shlex.split(line))
    assert "python3.11 -m venv .venv" in stdout  # --python: jax 0.10 needs Python 3.11
    assert "run.dir=/shared/runs/pt" in stdout
    assert only(calls, "gcloud", "compute", "tpus", "queued-resources", "delete")["flags"][
        "--force"] is True


def test_gke_section_builds_the_cluster_image_and_a_jobset_that_mounts_the_bucket(tmp_path):
    calls, _, work = run_section("gke", tmp_path)
    cluster = only(calls, "gcloud", "container", "clusters", "create")
    assert "GcsFuseCsiDriver" in cluster["flags"]["--addons"].split(",")
    assert cluster["flags"]["--workload-pool"].endswith(".svc.id.goog")
    pool = only(calls, "gcloud", "container", "node-pools", "create")
    assert pool["flags"]["--cluster"] == cluster["positionals"][0]
    applied = [c for c in calls if c["argv"][:2] == ["kubectl", "apply"]]
    assert [c["flags"]["-f"] for c in applied][1:] == ["pt-1.yaml"]
    assert cli_table.JOBSET_RELEASE.fullmatch(applied[0]["flags"]["-f"])  # the controller first
    bucket = only(calls, "gcloud", "storage", "buckets", "create")["positionals"][0]
    account = only(calls, "kubectl", "create", "serviceaccount")["positionals"][0]
    grants = [c for c in calls if c["command"] == ["storage", "buckets", "add-iam-policy-binding"]]
    assert [g["positionals"] for g in grants] == [[bucket], [bucket]]
    pool_id = f"/workloadIdentityPools/{cluster['flags']['--workload-pool']}/subject/ns/default/sa/"
    # the JobSet's pods' service account, then XPK's pods' (`default`)
    assert [g["flags"]["--member"].split(pool_id)[1] for g in grants] == [account, "default"]
    image = only(calls, "docker", "build")["flags"]["-t"]
    assert only(calls, "docker", "push")["positionals"] == [image]

    manifest = yaml.safe_load((work / "pt-1.yaml").read_text())
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    spec = pod["spec"]
    # The node pool is the slice the JobSet selects (v5e: machine type ct5lp, topology).
    assert pool["flags"]["--machine-type"].startswith("ct5lp-")
    assert spec["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                    "cloud.google.com/gke-tpu-topology": pool["flags"]["--tpu-topology"]}
    assert spec["serviceAccountName"] == account
    (volume,) = spec["volumes"]
    assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    assert volume["csi"]["volumeAttributes"]["bucketName"] == bucket.removeprefix("gs://")
    (container,) = spec["containers"]
    assert container["image"] == image
    assert container["volumeMounts"] == [{"name": volume["name"], "mountPath": "/shared"}]
    assert "run.dir=/shared/runs/pt-1" in container["command"][-1]

    # XPK: the same image, bucket and mount, one slice, the command through tpu_env.py.
    assert only(calls, "xpk", "cluster", "create")["flags"]["--enable-gcsfuse-csi-driver"] is True
    storage = only(calls, "xpk", "storage", "attach")
    assert storage["flags"]["--type"] == "gcsfuse" and storage["flags"]["--bucket"] == bucket.removeprefix("gs://")
    assert storage["flags"]["--mount-point"] == "/shared"
    workload = only(calls, "xpk", "workload", "create")
    assert workload["flags"]["--docker-image"] == image
    assert workload["flags"]["--num-slices"] == "1"
    wrapper, *command = shlex.split(workload["flags"]["--command"])[1:]
    assert wrapper == "/app/scripts/gke/tpu_env.py" and (REPO / wrapper.removeprefix("/app/")).is_file()
    assert command[0] == "tpu-train" and "run.dir=/shared/runs/pt-2" in command


@pytest.mark.parametrize("argv, message", [
    (["gcloud", "compute", "tpus", "queued-resources", "create", "q", "--zone=z",
      "--node-id=q", "--accelerator-type=v5litepod-16", "--runtime-versoin=x"],
     "unknown flag --runtime-versoin"),
    (["gcloud", "compute", "tpus", "queued-resource", "create", "q"], "not a subcommand"),
    (["kubectl", "apply", "-f"], "-f needs a value"),
    (["xpk", "workload", "create", "--cluster", "c", "--workload", "w", "--tpu-type", "t"],
     "missing --command"),
])
def test_the_table_refuses_what_the_tools_would(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cli_table.parse(argv)
