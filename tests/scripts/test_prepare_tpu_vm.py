"""scripts/prepare_tpu_vm.sh on a stand-in TPU VM: each command it would run (sudo, apt-get,
gcsfuse, mountpoint) is a stub that records its arguments, so the test sees what a fresh worker
gets (Python 3.11, gcsfuse from Google's repository, the bucket mounted) and that a second run
on a prepared worker changes nothing."""

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "prepare_tpu_vm.sh"

STUB = """#!{bash}
echo "{name} $*" >> "$CALLS"
{body}
"""
BODIES = {
    # sudo runs nothing for real; an apt-get install of gcsfuse makes the gcsfuse stub appear.
    "sudo": 'case "$*" in tee*) cat > /dev/null;; '
            '*"apt-get install"*gcsfuse*) cat "$STUBS/.gcsfuse" > "$STUBS/gcsfuse"; '
            'chmod +x "$STUBS/gcsfuse";; esac',
    "curl": "", "lsb_release": "echo jammy",
    "mountpoint": '[ -f "$STUBS/.mounted" ]',
    ".gcsfuse": "",
    "python3.11": "",
}


def _vm(tmp_path: Path, installed: bool, mounted: bool):
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    bash = shutil.which("bash")
    for name, body in BODIES.items():
        if name == "python3.11" and not installed:
            continue
        path = stubs / name
        path.write_text(STUB.format(bash=bash, name=name.lstrip("."), body=body))
        path.chmod(0o755)
    if installed:
        shutil.copy(stubs / ".gcsfuse", stubs / "gcsfuse")
    if mounted:
        (stubs / ".mounted").touch()
    (stubs / "id").symlink_to(shutil.which("id"))
    for tool in ("cat", "chmod"):
        (stubs / tool).symlink_to(shutil.which(tool))
    env = {"PATH": str(stubs), "STUBS": str(stubs), "CALLS": str(tmp_path / "calls"),
           "HOME": str(tmp_path)}
    return env


def _run(env, *args):
    done = subprocess.run([shutil.which("bash"), str(SCRIPT), *args], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    calls = Path(env["CALLS"]).read_text().splitlines() if os.path.exists(env["CALLS"]) else []
    return done, calls


def test_a_fresh_worker_gets_python_gcsfuse_and_the_mount(tmp_path):
    done, calls = _run(_vm(tmp_path, installed=False, mounted=False), "gs://my-bucket")
    assert done.returncode == 0, done.stderr
    # (the two sides of a pipe run at once: their order in the record is not fixed)
    assert "curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg" in calls
    assert "sudo tee /usr/share/keyrings/cloud.google.asc" in calls
    assert "sudo tee /etc/apt/sources.list.d/gcsfuse.list" in calls
    assert ("sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3.11 "
            "python3.11-venv gcsfuse") in calls
    owner = ":".join(str(n) for n in (os.getuid(), os.getgid()))
    assert calls[-4:] == ["mountpoint -q /shared", "sudo mkdir -p /shared",
                          f"sudo chown {owner} /shared",
                          "gcsfuse --implicit-dirs my-bucket /shared"]
    assert done.stdout.strip().endswith("gs://my-bucket mounted at /shared")


def test_a_prepared_worker_is_left_as_it_is(tmp_path):
    done, calls = _run(_vm(tmp_path, installed=True, mounted=True), "my-bucket", "/data")
    assert done.returncode == 0, done.stderr
    assert not [c for c in calls if c.startswith(("sudo", "gcsfuse", "curl"))], calls
    assert "/data is already mounted" in done.stdout


def test_usage_without_a_bucket(tmp_path):
    done, calls = _run(_vm(tmp_path, installed=True, mounted=False))
    assert done.returncode == 2 and calls == []
    assert done.stderr.startswith("usage: prepare_tpu_vm.sh BUCKET [MOUNT_POINT]")
