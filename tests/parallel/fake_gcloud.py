#!/usr/bin/env python3
"""A stand-in for ``gcloud compute tpus tpu-vm {describe,scp,ssh}`` on one machine, for the pod
launcher's tests: worker ``i`` of the slice is the directory ``$FAKE_TPU_ROOT/worker-i`` (its
login directory), ``ssh --command`` runs the command there with bash, ``scp`` copies into it.

Like a real remote command, the one ``ssh`` starts runs in a session of its own: killing this
process (the local ssh client) does not stop it. Every call is appended to
``$FAKE_TPU_ROOT/calls.log``.
"""

import os
import shutil
import subprocess
import sys


def main() -> int:
    root = os.environ["FAKE_TPU_ROOT"]
    args = sys.argv[1:]
    assert args[:3] == ["compute", "tpus", "tpu-vm"], args
    verb, rest = args[3], args[4:]
    with open(os.path.join(root, "calls.log"), "a") as log:
        log.write(repr([verb, *rest]) + "\n")
    if verb == "describe":
        print(os.environ["FAKE_TPU_IPS"])
        return 0
    worker = next((a.split("=", 1)[1] for a in rest if a.startswith("--worker=")), "0")
    home = os.path.join(root, f"worker-{worker}")
    os.makedirs(home, exist_ok=True)
    if verb == "scp":
        source, destination = [a for a in rest if not a.startswith("--")]
        shutil.copy(source, os.path.join(home, destination.split(":", 1)[1]))
        return 0
    if verb == "ssh":
        command = rest[rest.index("--command") + 1]
        env = dict(os.environ, HOME=home)
        # Output is relayed, as sshd does, so the remote command never holds this process's
        # own stdout: when this process dies, the caller sees the end of its output.
        remote = subprocess.Popen(["bash", "-c", command], cwd=home, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        for line in remote.stdout:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()
        return remote.wait()
    print(f"fake gcloud: unknown verb {verb}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
