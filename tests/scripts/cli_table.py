"""The subcommands and flags of the external CLIs that docs/tpu.md's pod and GKE sections use,
written from each tool's own reference, and a checker for one command line against them.

Sources: ``gcloud <command> --help`` of Google Cloud SDK 528.0.0 (every gcloud entry below was
checked against it); xpk's docs/usage (clusters.md, storage.md, workloads.md: ``xpk cluster
create --enable-gcsfuse-csi-driver``, ``xpk storage attach --type=gcsfuse``, ``xpk workload
create --docker-image --command``); JobSet's installation page (``kubectl apply --server-side -f
.../releases/download/VERSION/manifests.yaml``); kubectl's and docker's own help. What this can
catch is a subcommand or flag the tool does not have, a flag missing its value, or a wrong count
of positional arguments; it cannot tell whether the cloud accepts the values.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Spec:
    """One subcommand: its flags (name -> takes a value), positional count, required flags."""

    flags: dict
    positionals: tuple = (0, 0)
    required: tuple = ()


V, B = True, False  # a flag that takes a value / a boolean flag
_GCLOUD_WIDE = {"--project": V, "--format": V, "--quiet": B, "--verbosity": V}

TABLE = {
    "gcloud": {
        ("config", "set"): Spec({}, (2, 2)),
        ("projects", "describe"): Spec({}, (1, 1)),
        ("storage", "buckets", "create"): Spec(
            {"--location": V, "--uniform-bucket-level-access": B,
             "--enable-hierarchical-namespace": B, "--default-storage-class": V}, (1, 1)),
        ("storage", "buckets", "add-iam-policy-binding"): Spec(
            {"--member": V, "--role": V}, (1, 1), ("--member", "--role")),
        ("compute", "tpus", "queued-resources", "create"): Spec(
            {"--zone": V, "--node-id": V, "--accelerator-type": V, "--runtime-version": V,
             "--scopes": V, "--service-account": V, "--spot": B, "--guaranteed": B,
             "--reserved": B, "--network": V, "--subnetwork": V, "--internal-ips": B},
            (1, 1), ("--zone", "--node-id", "--accelerator-type", "--runtime-version")),
        ("compute", "tpus", "queued-resources", "describe"): Spec({"--zone": V}, (1, 1)),
        ("compute", "tpus", "queued-resources", "delete"): Spec(
            {"--zone": V, "--force": B, "--async": B}, (1, 1)),
        ("compute", "tpus", "tpu-vm", "describe"): Spec({"--zone": V}, (1, 1)),
        ("compute", "tpus", "tpu-vm", "scp"): Spec(
            {"--zone": V, "--worker": V, "--internal-ip": B, "--recurse": B}, (2, 10)),
        ("compute", "tpus", "tpu-vm", "ssh"): Spec(
            {"--zone": V, "--worker": V, "--command": V, "--internal-ip": B}, (1, 1)),
        ("container", "clusters", "create"): Spec(
            {"--location": V, "--node-locations": V, "--num-nodes": V, "--machine-type": V,
             "--workload-pool": V, "--addons": V, "--release-channel": V,
             "--cluster-version": V}, (1, 1)),
        ("container", "clusters", "get-credentials"): Spec({"--location": V}, (1, 1)),
        ("container", "node-pools", "create"): Spec(
            {"--cluster": V, "--location": V, "--node-locations": V, "--machine-type": V,
             "--tpu-topology": V, "--num-nodes": V, "--spot": B, "--reservation": V,
             "--reservation-affinity": V}, (1, 1), ("--cluster", "--machine-type")),
        ("artifacts", "repositories", "create"): Spec(
            {"--location": V, "--repository-format": V, "--description": V}, (1, 1),
            ("--repository-format",)),
        ("auth", "configure-docker"): Spec({}, (0, 1)),
    },
    "kubectl": {
        ("apply",): Spec({"-f": V, "--server-side": B, "--force-conflicts": B}, (0, 0), ("-f",)),
        ("create", "serviceaccount"): Spec({}, (1, 1)),
        ("logs",): Spec({"-f": B, "-l": V, "-c": V, "--all-containers": B}, (0, 1)),
        ("delete", "jobset"): Spec({}, (1, 1)),
        ("get", "jobsets"): Spec({}, (0, 1)),
        ("get", "pods"): Spec({"-l": V}, (0, 1)),
    },
    "docker": {
        ("build",): Spec({"-t": V, "-f": V, "--platform": V}, (1, 1), ("-t",)),
        ("push",): Spec({}, (1, 1)),
    },
    "xpk": {
        ("cluster", "create"): Spec(
            {"--cluster": V, "--tpu-type": V, "--num-slices": V, "--zone": V, "--on-demand": B,
             "--spot": B, "--reservation": V, "--enable-gcsfuse-csi-driver": B}, (0, 0),
            ("--cluster", "--tpu-type")),
        ("storage", "attach"): Spec(
            {"--type": V, "--bucket": V, "--mount-point": V, "--readonly": V, "--auto-mount": V,
             "--size": V, "--cluster": V, "--zone": V, "--mount-options": V}, (1, 1),
            ("--type", "--cluster", "--mount-point", "--auto-mount", "--readonly")),
        ("workload", "create"): Spec(
            {"--cluster": V, "--workload": V, "--docker-image": V, "--tpu-type": V,
             "--num-slices": V, "--command": V, "--zone": V, "--max-restarts": V,
             "--priority": V, "--storage": V}, (0, 0),
            ("--cluster", "--workload", "--command", "--tpu-type")),
        ("workload", "list"): Spec({"--cluster": V, "--zone": V}, (0, 0), ("--cluster",)),
        ("workload", "delete"): Spec({"--cluster": V, "--workload": V, "--zone": V}, (0, 0),
                                     ("--cluster",)),
    },
}
# Flags every command of the tool takes.
WIDE = {"gcloud": _GCLOUD_WIDE, "xpk": {"--project": V}, "kubectl": {"-n": V, "--namespace": V},
        "docker": {}}


@dataclasses.dataclass
class Parsed:
    tool: str
    command: tuple
    flags: dict  # name -> value (True for a boolean flag)
    positionals: list


def parse(argv: list[str]) -> Parsed:
    """``argv`` (the tool first) checked against :data:`TABLE`; ValueError names what is wrong."""
    tool, rest = argv[0], argv[1:]
    if tool not in TABLE:
        raise ValueError(f"{tool} is not a tool of the table")
    words = [w for w in rest if not w.startswith("-")]
    command = next((c for c in sorted(TABLE[tool], key=len, reverse=True)
                    if tuple(words[:len(c)]) == c and rest[:len(c)] == list(c)), None)
    if command is None:
        raise ValueError(f"{tool} {' '.join(rest[:4])}: not a subcommand of the table")
    spec = TABLE[tool][command]
    known = {**WIDE[tool], **spec.flags}
    flags, positionals, i = {}, [], len(command)
    while i < len(rest):
        token = rest[i]
        if token.startswith("-") and token != "-":
            name, eq, value = token.partition("=")
            if name not in known:
                raise ValueError(f"{tool} {' '.join(command)}: unknown flag {name}")
            if known[name] and not eq:
                if i + 1 >= len(rest):
                    raise ValueError(f"{tool} {' '.join(command)}: {name} needs a value")
                value, i = rest[i + 1], i + 1
            elif not known[name] and eq:
                raise ValueError(f"{tool} {' '.join(command)}: {name} takes no value")
            flags[name] = value if known[name] else True
        else:
            positionals.append(token)
        i += 1
    low, high = spec.positionals
    if not low <= len(positionals) <= high:
        raise ValueError(f"{tool} {' '.join(command)}: {len(positionals)} positional "
                         f"argument(s) {positionals}, expected {low}..{high}")
    missing = [f for f in spec.required if f not in flags]
    if missing:
        raise ValueError(f"{tool} {' '.join(command)}: missing {', '.join(missing)}")
    return Parsed(tool, command, flags, positionals)


JOBSET_RELEASE = re.compile(
    r"https://github\.com/kubernetes-sigs/jobset/releases/download/v\d+\.\d+\.\d+/manifests\.yaml")
