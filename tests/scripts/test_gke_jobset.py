"""scripts/gke/render_jobset.py: the JobSets for a v5e-16 and a v5p-32 slice, parsed as YAML and
checked field by field against what GKE needs (node selectors of the slice, one pod per host,
all of a host's chips per pod, the shared storage mounted in every pod) and against the TPU VM
launcher's environment; scripts/gke/tpu_env.py, the same environment from GKE's variables."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RENDER = REPO / "scripts" / "gke" / "render_jobset.py"
EXAMPLE = "tpu-train recipe=llama_pretrain parallel.data=1 parallel.fsdp=-1 run.dir=/shared/runs/{}"
STORAGE = ("--bucket", "my-bucket", "--service-account", "tpu-train")  # the examples' storage


def _render(*args):
    return subprocess.run([sys.executable, str(RENDER), *args], capture_output=True, text=True,
                          timeout=60)


def _vm_launcher_environment(num_workers: int) -> dict:
    """What scripts/launch_pod.sh exports on worker 1 of a slice (its dry run)."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "launch_pod.sh"), "--dry-run", "--no-sync", "--no-setup",
         "--num-workers", str(num_workers), "--coordinator-ip", "10.0.0.2", "--run-id", "r",
         "tpu", "true"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    launch = [line for line in done.stdout.splitlines() if "--worker=1" in line][0]
    script = shlex.split(launch)[shlex.split(launch).index("--command") + 1]
    exported = re.search(r"export (.*?) && ", script).group(1)
    return dict(item.split("=", 1) for item in shlex.split(exported))


# slice -> (hosts, GKE accelerator label, topology)
CASES = {"v5e-16": (4, "tpu-v5-lite-podslice", "4x4"),
         "v5p-32": (4, "tpu-v5p-slice", "2x2x4")}


@pytest.mark.parametrize("slice_name", sorted(CASES))
def test_jobset_for_a_slice_carries_its_topology_hosts_chips_and_environment(slice_name):
    hosts, accelerator, topology = CASES[slice_name]
    name = f"pretrain-{slice_name}"
    done = _render("--slice", slice_name, "--image", "REGISTRY/tpu-train:latest", "--name", name,
                   "--env", "HF_HOME=/shared/hf", *STORAGE, EXAMPLE.format(name))
    assert done.returncode == 0, done.stderr
    manifest = yaml.safe_load(done.stdout)
    assert manifest["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and manifest["kind"] == "JobSet"
    assert manifest["metadata"]["name"] == name
    assert manifest["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] \
        == "cloud.google.com/gke-nodepool"
    assert manifest["spec"]["network"]["enableDNSHostnames"] is True
    (replicated,) = manifest["spec"]["replicatedJobs"]
    assert replicated["name"] == "workers" and replicated["replicas"] == 1
    job = replicated["template"]["spec"]
    assert job["parallelism"] == job["completions"] == hosts
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": accelerator,
                                   "cloud.google.com/gke-tpu-topology": topology}
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["image"] == "REGISTRY/tpu-train:latest"
    assert container["command"] == ["bash", "-c", EXAMPLE.format(name)]
    chips = {"google.com/tpu": 4}
    assert container["resources"] == {"requests": chips, "limits": chips}

    env = {e["name"]: e for e in container["env"]}
    assert len(env) == len(container["env"])
    assert env.pop("RANK") == {"name": "RANK", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
    values = {k: e["value"] for k, e in env.items()}
    coordinator = f"{name}-workers-0-0.{name}"
    assert values == {
        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": str(hosts),
        "MASTER_ADDR": coordinator, "MASTER_PORT": "8476",
        "TPU_TRAIN_JAX_COORDINATOR": f"{coordinator}:8477", "TPU_TRAIN_RUN_ID": name,
        "TPU_TRAIN_PLATFORM": "tpu", "PYTHONUNBUFFERED": "1", "HF_HOME": "/shared/hf"}
    # The same variables as the TPU VM launcher's workers get.
    vm = _vm_launcher_environment(hosts)
    assert set(vm) == set(values) - {"HF_HOME"} | {"RANK"}
    assert [p["containerPort"] for p in container["ports"]] == [8476, 8477]

    # The bucket, through GKE's Cloud Storage FUSE CSI driver, at /shared in every pod.
    assert job["template"]["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    assert pod["serviceAccountName"] == "tpu-train"
    assert pod["volumes"] == [{"name": "shared", "csi": {
        "driver": "gcsfuse.csi.storage.gke.io",
        "volumeAttributes": {"bucketName": "my-bucket", "mountOptions": "implicit-dirs",
                             "hostNetworkPodKSA": "true"}}}]
    assert pod["hostNetwork"] is True  # why the volume needs hostNetworkPodKSA
    assert container["volumeMounts"] == [{"name": "shared", "mountPath": "/shared"}]


@pytest.mark.parametrize("slice_name", sorted(CASES))
def test_the_checked_in_manifests_are_what_the_script_renders(slice_name):
    name = f"pretrain-{slice_name}"
    done = _render("--slice", slice_name, "--image", "REGISTRY/tpu-train:latest", "--name", name,
                   *STORAGE, EXAMPLE.format(name))
    assert done.returncode == 0, done.stderr
    assert (REPO / "scripts" / "gke" / f"{slice_name}.yaml").read_text() == done.stdout


def test_every_known_slice_has_whole_hosts_and_the_chips_its_name_says():
    sys.path.insert(0, str(RENDER.parent))
    try:
        import render_jobset
    finally:
        sys.path.remove(str(RENDER.parent))
    for name, tpu in render_jobset.SLICES.items():
        count = int(name.split("-")[1])
        per_chip = 2 if name.startswith(("v4-", "v5p-")) else 1  # TensorCores in the name
        assert tpu.chips * per_chip == count, name
        assert tpu.hosts > 1 and tpu.hosts * tpu.chips_per_host == tpu.chips, name


def test_a_claim_is_mounted_without_the_fuse_annotation():
    done = _render("--slice", "v5e-16", "--image", "img", "--pvc", "filestore-share",
                   "--mount", "/data/", "tpu-train run.dir=/data/runs/a")
    assert done.returncode == 0, done.stderr
    job = yaml.safe_load(done.stdout)["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]
    assert pod["metadata"]["annotations"] == {}
    assert pod["spec"]["serviceAccountName"] == "default"
    assert pod["spec"]["volumes"] == [{"name": "shared",
                                       "persistentVolumeClaim": {"claimName": "filestore-share"}}]
    assert pod["spec"]["containers"][0]["volumeMounts"] == [{"name": "shared", "mountPath": "/data"}]


@pytest.mark.parametrize("args, message", [
    (("--slice", "v9-16"), "unknown --slice 'v9-16'; known: v5e-16"),
    (("--slice", "v5e-16", "--name", "Bad_Name"), "--name 'Bad_Name' must be"),
    (("--slice", "v5e-16", "--env", "X"), "--env needs KEY=VALUE"),
    (("--slice", "v5e-16", "--mount", "shared"), "--mount 'shared' must be an absolute directory"),
    (("--slice", "v5e-16", "--pvc", "c"), "not allowed with argument --bucket"),
    (("--slice", "v5e-16", "--service-account", "Tpu_Train"), "--service-account 'Tpu_Train'"),
])
def test_bad_options_fail_with_one_line(args, message):
    done = _render("--image", "img", "--bucket", "b", *args, "true")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert message in done.stderr


def test_v5litepod_spelling_is_v5e():
    done = _render("--slice", "v5litepod-16", "--image", "img", "--pvc", "fs", "true")
    assert done.returncode == 0, done.stderr
    assert "for v5e-16" in done.stdout


def test_storage_is_required_and_the_run_directory_must_be_on_it():
    no_storage = _render("--slice", "v5e-16", "--image", "img", "true")
    assert no_storage.returncode == 2 and "one of the arguments --bucket --pvc is required" \
        in no_storage.stderr
    for command, message in (
            ("tpu-train run.dir=/tmp/runs/a", "run.dir=/tmp/runs/a is not under the shared "
             "mount /shared: every host writes its shards there; use run.dir=/shared/runs/a"),
            ("tpu-train run.dir=runs/a", "run.dir=runs/a is not under the shared mount")):
        done = _render("--slice", "v5e-16", "--image", "img", "--name", "a", "--bucket", "b",
                       command)
        assert done.returncode == 2 and done.stdout == "" and message in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    url = _render("--slice", "v5e-16", "--image", "img", "--bucket", "gs://b", "true")
    assert "--bucket takes the bucket's name, not a URL: --bucket b" in url.stderr


def _tpu_env(env: dict, *command):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "MASTER_", "RANK",
                                                                      "WORLD_", "MEGASCALE"))}
    return subprocess.run([sys.executable, str(RENDER.parent / "tpu_env.py"), *command],
                          env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_tpu_env_gives_an_xpk_pod_the_environment_a_rendered_jobset_gives():
    """GKE's variables for worker 2 of a v5e-16 JobSet named pt-2 (XPK's host names) become the
    variables render_jobset writes into each pod, RANK being the worker id."""
    hosts = ",".join(f"pt-2-slice-job-0-{i}.pt-2" for i in range(4))
    done = _tpu_env({"TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": hosts}, "env")
    assert done.returncode == 0, done.stderr
    got = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    rendered = yaml.safe_load(_render("--slice", "v5e-16", "--image", "img", "--bucket", "b",
                                      "--name", "pt-2", "true").stdout)
    container = rendered["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]
    expected = {e["name"]: e.get("value") for e in container["env"]}
    expected["RANK"] = "2"
    coordinator = "pt-2-slice-job-0-0.pt-2"  # XPK's worker 0, not render_jobset's name for it
    expected["MASTER_ADDR"] = coordinator
    expected["TPU_TRAIN_JAX_COORDINATOR"] = f"{coordinator}:8477"
    assert {k: got.get(k) for k in expected} == expected


@pytest.mark.parametrize("env, message", [
    ({}, "TPU_WORKER_HOSTNAMES is not set"),
    ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "2"}, "TPU_WORKER_ID='2' must be a worker "
     "index below 2"),
    ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0", "MEGASCALE_NUM_SLICES": "two"},
     "MEGASCALE_NUM_SLICES='two' must be a positive integer"),
    ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0", "MEGASCALE_NUM_SLICES": "2",
      "MEGASCALE_SLICE_ID": "2", "MEGASCALE_COORDINATOR_ADDRESS": "a"},
     "MEGASCALE_SLICE_ID='2' must be a slice index below 2"),
    ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "0", "MEGASCALE_NUM_SLICES": "2",
      "MEGASCALE_SLICE_ID": "1"}, "MEGASCALE_COORDINATOR_ADDRESS='' must name slice 0's worker 0"),
])
def test_tpu_env_outside_a_tpu_slice_pod_fails_with_one_line(env, message):
    done = _tpu_env(env, "true")
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_tpu_env_numbers_the_hosts_of_two_slices_as_one_job():
    """XPK's variables for a 2-slice workload of 2-host slices named ms: each slice's pods see
    their own host names; the job has ranks 0..3, one coordinator (slice 0's worker 0) and one
    run id."""
    coordinator = "ms-slice-job-0-0.ms"
    got = []
    for slice_id in range(2):
        hosts = ",".join(f"ms-slice-job-{slice_id}-{i}.ms" for i in range(2))
        for worker in range(2):
            done = _tpu_env({"TPU_WORKER_ID": str(worker), "TPU_WORKER_HOSTNAMES": hosts,
                             "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": str(slice_id),
                             "MEGASCALE_COORDINATOR_ADDRESS": f"{coordinator}:8080"}, "env")
            assert done.returncode == 0, done.stderr
            got.append(dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line))
    assert [env["RANK"] for env in got] == ["0", "1", "2", "3"]
    assert {env["WORLD_SIZE"] for env in got} == {"4"}
    assert {env["MASTER_ADDR"] for env in got} == {coordinator}
    assert {env["TPU_TRAIN_JAX_COORDINATOR"] for env in got} == {f"{coordinator}:8477"}
    assert {env["TPU_TRAIN_RUN_ID"] for env in got} == {"ms"}
