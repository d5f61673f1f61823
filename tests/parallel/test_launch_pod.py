"""scripts/launch_pod.sh (``tpu_train.distributed.pod``): the commands it runs on each worker
(dry run), its argument errors, and whole launches against a stand-in for gcloud in which
each worker of the slice is a local directory (tests/parallel/fake_gcloud.py): sync, setup
once, per-worker logs, and the job stopped everywhere when a worker fails or on Ctrl-C."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import process_gone

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "launch_pod.sh"
FAKE_GCLOUD = Path(__file__).with_name("fake_gcloud.py")


def _launch(*args, env=None, cwd=REPO, timeout=120):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def _dry_run_steps(stdout: str) -> dict:
    """``{(worker, step): [argv, ...]}`` from the dry run's ``# worker N: step`` sections."""
    steps, current = {}, None
    for line in stdout.splitlines():
        header = re.match(r"# worker (\d+): (\w+)", line)
        if header:
            current = (int(header.group(1)), header.group(2))
            steps[current] = []
        elif line.startswith("gcloud ") and current:
            steps[current].append(shlex.split(line))
    return steps


def _remote(argv):
    return argv[argv.index("--command") + 1]


def _exports(script: str) -> dict:
    exported = re.search(r"export (.*?) && ", script).group(1)
    return dict(item.split("=", 1) for item in shlex.split(exported))


V5E_16 = ("--dry-run", "--zone", "us-west4-a", "--project", "proj", "--num-workers", "4",
          "--coordinator-ip", "10.130.0.2", "--run-id", "r-1", "--env", "HF_HOME=/mnt/hf",
          "--workdir", "/opt/tt", "my-v5e-16",
          "tpu-train recipe=llama_finetune parallel.fsdp=-1 run.dir=/mnt/runs/ft")


def test_dry_run_of_a_v5e_16_prints_sync_setup_and_launch_for_each_of_its_4_workers():
    proc = _launch(*V5E_16)
    assert proc.returncode == 0, proc.stderr
    assert "logs in runs/pod/r-1/workers" in proc.stdout.splitlines()[0]
    steps = _dry_run_steps(proc.stdout)
    assert set(steps) == {(w, s) for w in range(4)
                          for s in ("sync", "setup", "launch", "teardown")}
    for worker in range(4):
        for argv in sum((steps[worker, s] for s in ("sync", "setup", "launch", "teardown")), []):
            assert argv[:4] == ["gcloud", "compute", "tpus", "tpu-vm"]
            assert f"--worker={worker}" in argv
            assert "--zone=us-west4-a" in argv and "--project=proj" in argv
        scp, unpack = steps[worker, "sync"]
        assert scp[4] == "scp" and scp[-4] == "my-v5e-16:.tpu_train-r-1.tar.gz"
        assert "tar -xzf .tpu_train-r-1.tar.gz -C /opt/tt" in _remote(unpack)
        (setup,) = steps[worker, "setup"]
        assert _remote(setup).startswith("cd /opt/tt && ")
        for piece in ("--index-url https://download.pytorch.org/whl/cpu",
                      'pip install -q -c constraints.txt -e ".[tpu]"'):
            assert piece in _remote(setup)
        (launch,) = steps[worker, "launch"]
        script = _remote(launch)
        assert _exports(script) == {
            "RANK": str(worker), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "4",
            "MASTER_ADDR": "10.130.0.2", "MASTER_PORT": "8476",
            "TPU_TRAIN_JAX_COORDINATOR": "10.130.0.2:8477", "TPU_TRAIN_RUN_ID": "r-1",
            "TPU_TRAIN_PLATFORM": "tpu", "PYTHONUNBUFFERED": "1", "HF_HOME": "/mnt/hf"}
        # The user's command runs last, in the process group that teardown stops.
        assert script.endswith("parallel.fsdp=-1 run.dir=/mnt/runs/ft'")
        assert "setsid --wait" in script and ".tpu_train_pod/r-1.pgid" in script
        # ... and its output also goes to a log beside the run, on the worker.
        assert f"exec > >(tee -a /mnt/runs/ft/workers/worker-{worker}.log) 2>&1" in script
        assert "kill -TERM -- -$g" in _remote(steps[worker, "teardown"][0])


def test_python_m_tpu_train_launch_pod_is_the_same_launcher():
    script = _launch(*V5E_16)
    module = subprocess.run([sys.executable, "-m", "tpu_train.launch", "pod", *V5E_16],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert module.returncode == 0, module.stderr
    assert module.stdout == script.stdout


def test_dry_run_without_addresses_prints_the_lookup():
    proc = _launch("--dry-run", "--zone", "europe-west4-a", "--no-sync", "pod", "hostname")
    assert proc.returncode == 0, proc.stderr
    describe = shlex.split(proc.stdout.splitlines()[1])
    assert describe[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "pod"]
    assert "WORLD_SIZE=N" in proc.stdout and "sync" not in proc.stdout


def test_dry_run_over_two_slices_of_two_workers_numbers_them_as_one_job():
    proc = _launch("--dry-run", "--num-workers", "2", "--coordinator-ip", "10.0.0.2", "--run-id",
                   "ms", "--workdir", "/opt/tt", "my-ms-0,my-ms-1", "tpu-train recipe=x")
    assert proc.returncode == 0, proc.stderr
    steps = _dry_run_steps(proc.stdout)
    assert set(steps) == {(w, s) for w in range(4)
                          for s in ("sync", "setup", "launch", "teardown")}
    for rank in range(4):
        tpu, worker = f"my-ms-{rank // 2}", rank % 2
        for step in ("sync", "setup", "launch", "teardown"):
            for argv in steps[rank, step]:
                assert f"--worker={worker}" in argv
                assert tpu in argv or f"{tpu}:.tpu_train-ms.tar.gz" in argv
        (launch,) = steps[rank, "launch"]
        exports = _exports(_remote(launch))
        assert {k: exports[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TPU_TRAIN_RUN_ID",
                                        "MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_PORT",
                                        "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID")} == {
            "RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.2",
            "TPU_TRAIN_RUN_ID": "ms", "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2:8081",
            "MEGASCALE_PORT": "8081", "MEGASCALE_NUM_SLICES": "2",
            "MEGASCALE_SLICE_ID": str(rank // 2)}


def test_one_slice_gets_no_megascale_variables():
    proc = _launch(*V5E_16)
    assert "MEGASCALE" not in proc.stdout


def test_dry_run_over_two_slices_without_addresses_looks_up_both():
    proc = _launch("--dry-run", "--no-sync", "ms-0,ms-1", "hostname")
    assert proc.returncode == 0, proc.stderr
    described = [shlex.split(line)[5] for line in proc.stdout.splitlines()
                 if line.startswith("gcloud compute tpus tpu-vm describe")]
    assert described == ["ms-0", "ms-1"]
    (launch,) = _dry_run_steps(proc.stdout)[0, "launch"]
    assert _exports(_remote(launch))["WORLD_SIZE"] == "2*N"


@pytest.mark.parametrize("args, message", [
    (("pod",), "the following arguments are required: command"),
    (("--bogus", "pod", "cmd"), "unrecognized arguments: --bogus"),
    (("--port", "x", "pod", "cmd"), "argument --port: invalid int value"),
    (("--port", "70000", "pod", "cmd"), "--port must be 1-65534"),
    (("--num-workers", "0", "pod", "cmd"), "--num-workers must be a positive integer"),
    (("--env", "NOVALUE", "pod", "cmd"), "--env needs KEY=VALUE"),
    (("--env", "1X=2", "pod", "cmd"), "--env needs KEY=VALUE"),
    (("--run-id", "a b", "pod", "cmd"), "--run-id may hold only"),
    (("--source", "/", "pod", "cmd"), "is not a tpu_train checkout"),
    (("pod", "  "), "the command is empty"),
    (("ms-0,ms-0", "cmd"), "several distinct ones, comma-separated"),
    (("ms-0,", "cmd"), "several distinct ones, comma-separated"),
])
def test_bad_arguments_fail_with_one_line(args, message):
    proc = _launch("--dry-run", *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("launch_pod: error: ") and message in proc.stderr


# --- whole launches against the stand-in for gcloud ---------------------------------------

@pytest.fixture
def fake_slice(tmp_path):
    """The environment in which ``gcloud`` is the stand-in, for a slice of two workers (as
    ``describe`` reports them); returns (env, root of the workers' login directories)."""
    root, bin_dir = tmp_path / "slice", tmp_path / "bin"
    root.mkdir()
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {FAKE_GCLOUD} \"$@\"\n")
    gcloud.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               FAKE_TPU_ROOT=str(root), FAKE_TPU_IPS="10.0.0.2;10.0.0.3")
    yield env, root
    for pid_file in root.glob("worker-*/pid"):  # nothing a failed test started outlives it
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture
def checkout(tmp_path):
    """A git checkout to sync: tracked files, an untracked one and an ignored one."""
    source = tmp_path / "checkout"
    source.mkdir()
    for name, text in {"pyproject.toml": "[project]\nname = 'x'\n", "constraints.txt": "",
                       "marker.txt": "synced-marker\n", ".gitignore": "ignored.txt\n",
                       "ignored.txt": "must stay here\n", "notes.txt": "untracked\n"}.items():
        (source / name).write_text(text)
    subprocess.run(["git", "init", "-q", str(source)], check=True)
    subprocess.run(["git", "-C", str(source), "add", "pyproject.toml", "constraints.txt",
                    "marker.txt", ".gitignore"], check=True)
    return source


REPORT = ('echo "rank=$RANK world=$WORLD_SIZE platform=$TPU_TRAIN_PLATFORM '
          'master=$MASTER_ADDR:$MASTER_PORT"; cat marker.txt; : run.dir=runs/$TPU_TRAIN_RUN_ID')


def test_a_launch_syncs_sets_up_once_and_logs_every_worker(fake_slice, checkout, tmp_path):
    env, root = fake_slice
    logs = tmp_path / "logs"
    args = ("--setup", "echo setting-up; touch ../setup-ran", "--log-dir", str(logs),
            "--run-id", "r-7", "my-tpu", REPORT)
    first = _launch(*args, env=env, cwd=checkout)
    assert first.returncode == 0, first.stderr
    for worker in range(2):
        log = (logs / f"worker-{worker}.log").read_text()
        assert f"rank={worker} world=2 platform=tpu master=10.0.0.2:8476" in log
        assert "synced-marker" in log and "setting-up" in log
        home = root / f"worker-{worker}"
        assert (home / "setup-ran").exists()
        synced = {p.name for p in (home / "tpu_train").iterdir()}
        assert {"marker.txt", "notes.txt", "pyproject.toml"} <= synced
        assert "ignored.txt" not in synced
        # The command set run.dir: its output is also in a log beside the run, on the worker.
        beside = (home / "tpu_train" / "runs" / "r-7" / "workers" / f"worker-{worker}.log")
        assert f"rank={worker} world=2" in beside.read_text()
    # Worker 0's output is printed; the others' go to their logs only.
    assert "rank=0 world=2" in first.stdout and "rank=1" not in first.stdout
    assert "describe" in (root / "calls.log").read_text()

    second = _launch(*args, env=env, cwd=checkout)
    assert second.returncode == 0, second.stderr
    for worker in range(2):
        log = (logs / f"worker-{worker}.log").read_text()
        lines = log.splitlines()  # output lines (the log also shows each command run)
        assert lines.count("setting-up") == 1 and lines.count("setup: up to date") == 1


# Workers 0, 1 and 3 start and wait; worker 2 fails once the three are running.
FAIL_ON_2 = ('if [ "$RANK" = 2 ]; then '
             'while [ "$(ls ../../worker-*/started 2>/dev/null | wc -l)" -lt 3 ]; do sleep 0.1; done; '
             'echo "boom on worker $RANK"; exit 3; fi; '
             'echo $$ > ../pid; touch ../started; exec sleep 300')


def test_a_failing_worker_stops_the_job_on_every_worker(fake_slice, checkout, tmp_path):
    env, root = fake_slice
    logs = tmp_path / "logs"
    proc = _launch("--num-workers", "4", "--coordinator-ip", "10.0.0.2", "--no-setup",
                   "--grace", "1", "--log-dir", str(logs), "my-tpu", FAIL_ON_2,
                   env=env, cwd=checkout)
    assert proc.returncode == 3, proc.stderr
    assert "launch_pod: worker 2 failed in launch (exit status 3)" in proc.stderr
    assert "boom on worker 2" in proc.stderr  # the end of its log
    for worker in (0, 1, 3):
        pid = int((root / f"worker-{worker}" / "pid").read_text())
        assert process_gone(pid), f"worker {worker}'s command (pid {pid}) still runs"
        assert "stopped process group" in (logs / f"worker-{worker}.log").read_text()
    assert sorted(p.name for p in logs.iterdir()) == [f"worker-{i}.log" for i in range(4)]


def test_ctrl_c_stops_the_job_on_every_worker(fake_slice, checkout, tmp_path):
    env, root = fake_slice
    launcher = subprocess.Popen(
        ["bash", str(SCRIPT), "--no-setup", "--grace", "1", "--log-dir", str(tmp_path / "logs"),
         "my-tpu", "echo $$ > ../pid; touch ../started; exec sleep 300"],
        env=env, cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = [root / f"worker-{w}" / "started" for w in range(2)]
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(p.exists() for p in started), launcher.poll()
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signal.SIGINT, err
    assert "got signal 2 during launch; stopping the job on every worker" in err
    for worker in range(2):
        pid = int((root / f"worker-{worker}" / "pid").read_text())
        assert process_gone(pid), f"worker {worker}'s command (pid {pid}) still runs"


def test_slices_of_different_worker_counts_are_refused_before_anything_runs(monkeypatch):
    from tpu_train.distributed import pod
    endpoints = {"ms-0": "10.0.0.2;10.0.0.3", "ms-1": "10.0.1.2;10.0.1.3;10.0.1.4;10.0.1.5"}

    def describe(argv, **_):
        return subprocess.CompletedProcess(argv, 0, stdout=endpoints[argv[5]], stderr="")

    monkeypatch.setattr(pod.subprocess, "run", describe)
    args = pod.parse_args(["--no-sync", "ms-0,ms-1", "true"])
    with pytest.raises(pod.LaunchError, match=r"different worker counts \[2, 4\]"):
        pod.find_workers(args, pod.Commands(args, "bundle"))
    endpoints["ms-1"] = "10.0.1.2;10.0.1.3"
    assert pod.find_workers(args, pod.Commands(args, "bundle")) == ("10.0.0.2", 2)
