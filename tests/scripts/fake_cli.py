"""Stand-in for gcloud, kubectl, docker and xpk while docs/tpu.md's commands run in a test:
checks its command line against ``cli_table`` (and what the command refers to: the script a
``tpu-vm ssh --command`` runs is parsed by ``bash -n``, a file ``kubectl apply -f`` names must be
YAML, ``docker build`` needs a Dockerfile), records it, prints what the docs read back
(a project number, a queued resource's state) and does nothing else.

    python fake_cli.py TOOL ARGS...        (FAKE_CLI_LOG names the JSON-lines record)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli_table  # noqa: E402

# What a command prints that a later command reads, by subcommand.
OUTPUT = {("projects", "describe"): "123456789012",
          ("compute", "tpus", "queued-resources", "describe"): "ACTIVE"}


def check(parsed: cli_table.Parsed) -> None:
    """What the command names must exist and make sense; ValueError says what does not."""
    command, flags = parsed.command, parsed.flags
    if command[-1] == "ssh" and "--command" in flags:
        done = subprocess.run(["bash", "-n", "-c", flags["--command"]], capture_output=True,
                              text=True)
        if done.returncode:
            raise ValueError(f"tpu-vm ssh --command is not valid bash: {done.stderr.strip()}")
    if command[-1] == "scp":
        *sources, target = parsed.positionals
        if ":" not in target or any(not Path(s).is_file() for s in sources):
            raise ValueError(f"tpu-vm scp {parsed.positionals}: local files to TPU_NAME:")
    if parsed.tool == "kubectl" and command == ("apply",):
        target = flags["-f"]
        if target.startswith("https://"):
            if not cli_table.JOBSET_RELEASE.fullmatch(target) or "--server-side" not in flags:
                raise ValueError(f"kubectl apply -f {target}: expected JobSet's release "
                                 f"manifests, applied --server-side")
        else:
            documents = [d for d in yaml.safe_load_all(Path(target).read_text()) if d]
            if not documents or any("kind" not in d for d in documents):
                raise ValueError(f"kubectl apply -f {target}: no Kubernetes object in it")
    if parsed.tool == "docker" and command == ("build",):
        if not (Path(parsed.positionals[0]) / "Dockerfile").is_file():
            raise ValueError(f"docker build {parsed.positionals[0]}: no Dockerfile there")


def main() -> int:
    argv = sys.argv[1:]
    try:
        parsed = cli_table.parse(argv)
        check(parsed)
    except (ValueError, OSError, yaml.YAMLError) as error:
        print(f"fake {argv[0]}: {error}", file=sys.stderr)
        return 2
    with open(os.environ["FAKE_CLI_LOG"], "a") as log:
        log.write(json.dumps({"argv": argv, "command": parsed.command, "flags": parsed.flags,
                              "positionals": parsed.positionals}) + "\n")
    if parsed.command in OUTPUT:
        print(OUTPUT[parsed.command])
    return 0


if __name__ == "__main__":
    sys.exit(main())
