"""``python -m tpu_train.launch --nproc N script.py args...``: one process per device.

``-m module`` runs a module instead of a script, as ``python -m`` does:
``python -m tpu_train.launch --nproc 2 -m tpu_train.cli parallel.fsdp=-1 ...``.

Sets torch's launch environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) for each process, so the script calls
``dist.init_process_group("tpu")`` exactly as under torchrun. The JAX coordinator then listens
on ``MASTER_PORT + 1`` (see :mod:`tpu_train.distributed.init`). On one host the launcher draws
``MASTER_PORT`` below the kernel's ephemeral range (:mod:`tpu_train.distributed.ports`).

Multi-host: run the same command on every host with ``--nnodes``, ``--node-rank`` and
``--coordinator host:port`` (the host of node 0; the port is torch's store, port+1 JAX's).

On a TPU VM with ``--nproc`` > 1, each process is given its own chip through libtpu's
environment (:mod:`tpu_train.distributed.tpu_env`); ``--tpu-env off`` leaves it out, ``on``
sets it on a host where no chip is found (to inspect it).

When a rank exits with a failure, the launcher stops the others (SIGTERM, then SIGKILL after
``--grace`` seconds) and exits with that rank's status; each rank runs in its own session so that
nothing it started outlives the job. SIGINT/SIGTERM to the launcher stop every rank the same way.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from tpu_train.distributed import ports, tpu_env


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tpu_train.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, required=True,
                        help="processes on this host (one per device)")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--coordinator", default=None,
                        help="host:port of node 0 (torch's store; port+1 is JAX's coordinator)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping ranks")
    parser.add_argument("--tpu-env", choices=("auto", "on", "off"), default="auto",
                        help="give each process its own TPU chip through libtpu's environment "
                             "(auto: when the host has TPU chips and --nproc > 1)")
    parser.add_argument("--tpu-host-bounds", default=os.environ.get("TPU_HOST_BOUNDS"),
                        help="x,y,z grid of hosts of a multi-host slice (default: "
                             "TPU_HOST_BOUNDS)")
    parser.add_argument("--tpu-worker-hosts", default=os.environ.get("TPU_WORKER_HOSTNAMES"),
                        help="comma-separated addresses of every host, in node-rank order "
                             "(default: TPU_WORKER_HOSTNAMES)")
    parser.add_argument("-m", dest="module", default=None,
                        help="run this module (python -m MODULE) instead of a script")
    parser.add_argument("script", nargs="?", default=None)
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.nnodes > 1 and not args.coordinator:
        parser.error("--coordinator host:port is required with --nnodes > 1")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank must be in [0, {args.nnodes})")
    wanted = args.tpu_env == "on" or (args.tpu_env == "auto" and tpu_env.host_has_tpu_chips())
    args.tpu_slice = None
    if wanted and args.nproc > 1:
        try:
            args.tpu_slice = [
                tpu_env.slice_env(nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                                  local_rank=i, host_bounds=args.tpu_host_bounds,
                                  worker_hosts=args.tpu_worker_hosts)
                for i in range(args.nproc)]
        except tpu_env.TpuEnvError as error:
            parser.error(str(error))
    return args


def rank_env(args, local_rank: int, host: str, port: int) -> dict:
    env = dict(os.environ)
    env.update(RANK=str(args.node_rank * args.nproc + local_rank), LOCAL_RANK=str(local_rank),
               WORLD_SIZE=str(args.nnodes * args.nproc), LOCAL_WORLD_SIZE=str(args.nproc),
               GROUP_RANK=str(args.node_rank), MASTER_ADDR=host, MASTER_PORT=str(port),
               PYTHONUNBUFFERED="1")
    if getattr(args, "tpu_slice", None):
        env = tpu_env.apply(env, args.tpu_slice[local_rank])
    return env


def _die_with_launcher() -> None:
    """In the child: be killed when the launcher dies, even by SIGKILL (which it cannot
    forward), so that no rank outlives its job. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def stop(procs, grace: float) -> None:
    """SIGTERM every live rank's session, SIGKILL what is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(p.poll() is None for p in live):
            time.sleep(0.05)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.coordinator:
        host, _, port = args.coordinator.rpartition(":")
        port = int(port)
    else:
        host, port = "127.0.0.1", ports.free_port_pair()
    target = ["-m", args.module] if args.module else []
    rest = [args.script] if args.script is not None else []
    if not target and not rest:
        print("python -m tpu_train.launch: error: give a script to run, or -m MODULE",
              file=sys.stderr)
        return 2
    command = [sys.executable, "-u", *target, *rest, *args.script_args]
    procs = []
    stopping = {"signal": None}

    def on_signal(signum, frame):
        stopping["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for local_rank in range(args.nproc):
            procs.append(subprocess.Popen(command, env=rank_env(args, local_rank, host, port),
                                          start_new_session=True,
                                          preexec_fn=_die_with_launcher))
        while True:
            if stopping["signal"] is not None:
                print(f"[tpu_train.launch] got signal {stopping['signal']}; stopping all ranks",
                      file=sys.stderr, flush=True)
                stop(procs, args.grace)
                return 128 + stopping["signal"]
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                local, code = failed[0]
                rank = args.node_rank * args.nproc + local
                print(f"[tpu_train.launch] rank {rank} exited with status {code}; stopping the "
                      f"other ranks", file=sys.stderr, flush=True)
                stop(procs, args.grace)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        stop(procs, args.grace)
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
