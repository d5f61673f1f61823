#!/usr/bin/env python3
"""Render the JobSet that runs one tpu_train command on every host of a GKE TPU slice.

    python3 scripts/gke/render_jobset.py --slice v5e-16 --image IMAGE --name ft-1 \\
        --bucket BUCKET --service-account tpu-train \\
        "tpu-train recipe=llama_finetune parallel.fsdp=-1 run.dir=/shared/runs/ft-1" > ft-1.yaml
    kubectl apply -f ft-1.yaml

One pod per host (``completions`` = ``parallelism`` = the slice's host count), on the node pool
of the slice (``cloud.google.com/gke-tpu-accelerator`` and ``gke-tpu-topology`` node
selectors), each requesting all of its host's chips (``google.com/tpu``). Every pod gets the
environment the TPU VM launcher gives each worker (``tpu_train/distributed/pod.py``,
``job_environment``): worker 0's address is its JobSet host name, the rank its completion
index. The image must hold tpu_train installed with the ``[tpu]`` extra (the repository's
``Dockerfile``).

Every pod mounts the same storage at ``--mount`` (default ``/shared``), where the run directory
must be (each process writes its own shards of a checkpoint): a Cloud Storage bucket through
GKE's Cloud Storage FUSE CSI driver (``--bucket``; the pod's Kubernetes service account,
``--service-account``, needs access to it), or an existing PersistentVolumeClaim such as a
Filestore share (``--pvc``).

Only the standard library is used (``pod.py`` is loaded by path), so rendering needs neither
torch nor JAX.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import string
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "jobset.yaml.in"
REPLICATED_JOB = "workers"
_spec = importlib.util.spec_from_file_location(
    "tpu_train_pod", HERE.parents[1] / "tpu_train" / "distributed" / "pod.py")
pod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pod)


@dataclass(frozen=True)
class Slice:
    """A multi-host TPU slice as GKE names it: node labels and chips per host (every
    multi-host TPU node pool below has 4 chips per VM)."""

    accelerator: str  # cloud.google.com/gke-tpu-accelerator
    topology: str  # cloud.google.com/gke-tpu-topology
    chips_per_host: int = 4

    @property
    def chips(self) -> int:
        count = 1
        for side in self.topology.split("x"):
            count *= int(side)
        return count

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host


# The name's number counts chips for v5e and v6e, TensorCores (two per chip) for v4 and v5p.
SLICES = {
    **{f"v5e-{n}": Slice("tpu-v5-lite-podslice", t) for n, t in
       ((16, "4x4"), (32, "4x8"), (64, "8x8"), (128, "8x16"), (256, "16x16"))},
    **{f"v6e-{n}": Slice("tpu-v6e-slice", t) for n, t in
       ((16, "4x4"), (32, "4x8"), (64, "8x8"), (128, "8x16"), (256, "16x16"))},
    **{f"v5p-{n}": Slice("tpu-v5p-slice", t) for n, t in
       ((16, "2x2x2"), (32, "2x2x4"), (64, "2x4x4"), (128, "4x4x4"))},
    **{f"v4-{n}": Slice("tpu-v4-podslice", t) for n, t in
       ((16, "2x2x2"), (32, "2x2x4"), (64, "2x4x4"), (128, "4x4x4"))},
}
ALIASES = {"v5litepod-": "v5e-"}  # the TPU VM accelerator-type spelling of v5e
# Pod host names are <name>-<replicated job>-<job index>-<pod index>: 63 characters at most.
_NAME = re.compile(r"[a-z]([a-z0-9-]{0,38}[a-z0-9])?")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PATH = re.compile(r"[A-Za-z0-9._/-]+")
_K8S_NAME = re.compile(r"[a-z0-9]([a-z0-9._-]{0,220}[a-z0-9])?")  # also a bucket's name
VOLUME = "shared"
# Pods on the host network authenticate to the bucket as their Kubernetes service account only
# with this attribute (the Cloud Storage FUSE CSI driver's host-network support).
GCSFUSE_ATTRIBUTES = {"mountOptions": "implicit-dirs", "hostNetworkPodKSA": "true"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        print(f"render_jobset: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(prog="render_jobset", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", help="the command every host runs, one quoted string")
    parser.add_argument("--slice", required=True, help=f"one of {', '.join(SLICES)}")
    parser.add_argument("--image", required=True, help="container image with tpu_train[tpu]")
    parser.add_argument("--name", default="tpu-train",
                        help="JobSet name, also the run id (lowercase, digits, '-')")
    parser.add_argument("--port", type=int, default=pod.DEFAULT_PORT,
                        help="MASTER_PORT on worker 0 (port+1: JAX's coordinator)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="times the whole JobSet is restarted after a failure")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="another variable for the command (repeatable)")
    storage = parser.add_mutually_exclusive_group(required=True)
    storage.add_argument("--bucket", help="Cloud Storage bucket mounted at --mount (GCS FUSE "
                         "CSI driver)")
    storage.add_argument("--pvc", help="PersistentVolumeClaim mounted at --mount (e.g. Filestore)")
    parser.add_argument("--mount", default="/shared",
                        help="where every pod sees the shared storage (default: /shared)")
    parser.add_argument("--service-account", default="default",
                        help="the pods' Kubernetes service account (with --bucket: one that may "
                        "use the bucket; default: default)")
    args = parser.parse_args(argv)
    args.slice = next((args.slice.replace(a, b) for a, b in ALIASES.items()
                       if args.slice.startswith(a)), args.slice)
    if args.slice not in SLICES:
        parser.error(f"unknown --slice {args.slice!r}; known: {', '.join(SLICES)}")
    if not _NAME.fullmatch(args.name):
        parser.error(f"--name {args.name!r} must be 1-40 lowercase letters, digits or '-', "
                     f"starting with a letter")
    if not 0 < args.port < 65535 or args.max_restarts < 0:
        parser.error("--port must be 1-65534 and --max-restarts 0 or more")
    for item in args.env:
        key, sep, _ = item.partition("=")
        if not sep or not _ENV_KEY.fullmatch(key):
            parser.error(f"--env needs KEY=VALUE with KEY a variable name, got {item!r}")
    _check_storage(parser, args)
    return args


def _check_storage(parser, args) -> None:
    """The mount is an absolute path, and a ``run.dir`` the command sets lies under it: a run
    directory elsewhere is on each pod's own disk, where the other hosts' shards never arrive."""
    mount = args.mount.rstrip("/") or "/"
    if not mount.startswith("/") or mount == "/" or not _PATH.fullmatch(mount):
        parser.error(f"--mount {args.mount!r} must be an absolute directory such as /shared")
    args.mount = mount
    if args.bucket is not None and args.bucket.startswith("gs://"):
        parser.error(f"--bucket takes the bucket's name, not a URL: --bucket {args.bucket[5:]}")
    for option, value in (("--bucket", args.bucket), ("--pvc", args.pvc),
                          ("--service-account", args.service_account)):
        if value is not None and not _K8S_NAME.fullmatch(value):
            parser.error(f"{option} {value!r} must be lowercase letters, digits, '-' or '.'")
    run_dir = pod.run_dir_of(args.command, args.name)
    if run_dir is not None and not run_dir.startswith(mount + "/"):
        parser.error(f"run.dir={run_dir} is not under the shared mount {mount}: every host "
                     f"writes its shards there; use run.dir={mount}/runs/{args.name}")


def environment(args, tpu: Slice) -> list[dict]:
    """The pods' ``env`` list: RANK from the pod's completion index, then the VM launcher's."""
    coordinator = f"{args.name}-{REPLICATED_JOB}-0-0.{args.name}"
    values = pod.job_environment(num_workers=tpu.hosts, coordinator=coordinator,
                                 port=args.port, run_id=args.name)
    values.update(item.split("=", 1) for item in args.env)
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    return [{"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": index}}},
            *({"name": k, "value": v} for k, v in values.items())]


def storage(args) -> tuple[dict, dict]:
    """The pods' annotations and their shared volume: the bucket through the Cloud Storage FUSE
    CSI driver (whose sidecar GKE injects into pods annotated so), or the claim."""
    if args.bucket:
        source = {"csi": {"driver": "gcsfuse.csi.storage.gke.io",
                          "volumeAttributes": {"bucketName": args.bucket, **GCSFUSE_ATTRIBUTES}}}
        return {"gke-gcsfuse/volumes": "true"}, {"name": VOLUME, **source}
    return {}, {"name": VOLUME, "persistentVolumeClaim": {"claimName": args.pvc}}


def render(args) -> str:
    tpu = SLICES[args.slice]
    # JSON strings are YAML strings: every value is quoted exactly.
    env_lines = [f"              - {json.dumps(entry)}" for entry in environment(args, tpu)]
    annotations, volume = storage(args)
    return string.Template(TEMPLATE.read_text()).substitute(
        slice=args.slice, name=args.name, max_restarts=args.max_restarts,
        annotations=json.dumps(annotations), volume=json.dumps(volume),
        mount=json.dumps({"name": VOLUME, "mountPath": args.mount}),
        service_account=json.dumps(args.service_account), storage_note=_storage_note(args),
        coordinator=f"{args.name}-{REPLICATED_JOB}-0-0.{args.name}",
        replicated_job=REPLICATED_JOB, hosts=tpu.hosts, chips_per_host=tpu.chips_per_host,
        accelerator=tpu.accelerator, topology=json.dumps(tpu.topology),
        image=json.dumps(args.image), command=json.dumps(args.command),
        env="\n".join(env_lines), port=args.port, jax_port=args.port + 1)


def _storage_note(args) -> str:
    what = f"bucket {args.bucket}" if args.bucket else f"claim {args.pvc}"
    return f"{what} at {args.mount}"


def main(argv=None) -> int:
    sys.stdout.write(render(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
