"""Run one command on every worker (host) of a TPU VM slice, as one multi-host job.

    scripts/launch_pod.sh [options] TPU_NAME "COMMAND ..."
    python -m tpu_train.launch pod [options] TPU_NAME "COMMAND ..."

Three steps, each on all workers at once through ``gcloud compute tpus tpu-vm`` (one gcloud
process per worker, so that each worker has its own log and exit status):

1. **sync**: the checkout (``--source``, default the current directory: git's tracked files and
   untracked ones it does not ignore) is packed, copied to every worker with scp and unpacked
   into ``--workdir`` (default ``tpu_train`` in the login directory). ``--no-sync`` skips it.
2. **setup**, once per worker: a virtual environment ``.venv`` in the work directory with the
   CPU-only torch wheel (a TPU host needs no CUDA build) and ``pip install -c constraints.txt
   -e ".[tpu]"`` (libtpu). A stamp in ``.venv`` skips it while ``pyproject.toml``,
   ``constraints.txt`` and the setup command are unchanged. ``--setup CMD`` replaces the
   command, ``--no-setup`` skips the step.
3. **launch**: the command, in the work directory with ``.venv`` active, and the environment
   of the job (:func:`job_environment`, the variables ``tpu_train.distributed`` reads at
   start-up, ``TPU_TRAIN_PLATFORM=tpu`` among them; ``--env KEY=VALUE`` adds or overrides).

Every worker's output streams to ``<log dir>/worker-<i>.log`` here (``--log-dir``, default
``runs/pod/<run id>/workers``); worker 0's is also printed. When the command sets
``run.dir=...``, each worker also appends its output to ``<run.dir>/workers/worker-<i>.log``
on its own filesystem: beside the run, all workers' logs together when the run directory is on
storage the workers share (as a multi-host run's sharded checkpoints need). A run directory at
a URL (``gs://...``) gets no worker logs: a shell cannot append to an object.

When a worker fails, or on Ctrl-C, the launcher stops the job everywhere: the launch step
records its process group on each worker, and one more ssh per worker sends that group
SIGTERM, then SIGKILL after ``--grace`` seconds (closing ssh alone leaves the remote processes
running). ``--dry-run`` prints every command, per worker, and runs none.

**Several slices** (multislice, joined over the data-centre network): name every slice's TPU,
comma-separated and in slice order (``my-tpu-0,my-tpu-1``: a multislice queued resource names
its nodes ``<id>-0 ... <id>-<N-1>``; separately created slices of one type work the same way).
The workers of all slices form one job: ``RANK`` is ``slice * workers per slice + worker``,
``MASTER_ADDR`` slice 0's worker 0, and each worker also gets the variables libtpu joins slices
with: ``MEGASCALE_COORDINATOR_ADDRESS`` (slice 0's worker 0 and ``MEGASCALE_PORT``),
``MEGASCALE_NUM_SLICES`` and its ``MEGASCALE_SLICE_ID``. Logs are numbered by rank.

Only the standard library is imported, so ``scripts/launch_pod.sh`` runs this file on a
workstation that has gcloud and python3 but not torch or JAX.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

PROG = "launch_pod"
DEFAULT_PORT = 8476
MEGASCALE_PORT = 8081  # libtpu's port for joining slices (the value Ray and XPK use)
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
STATE_DIR = ".tpu_train_pod"  # in the work directory: each run's process-group file
SETUP_STAMP = ".venv/tpu_train-setup.sha256"
_NAME = re.compile(r"[A-Za-z0-9._-]+")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SKIPPED_WITHOUT_GIT = {".git", ".venv", "runs", "__pycache__", ".pytest_cache"}


def slice_environment(*, num_slices: int, slice_id: int, coordinator: str) -> dict:
    """What libtpu reads on a TPU VM to join ``num_slices`` slices over the data-centre
    network (GKE's multi-slice workloads set these themselves)."""
    return {
        "MEGASCALE_COORDINATOR_ADDRESS": f"{coordinator}:{MEGASCALE_PORT}",
        "MEGASCALE_PORT": str(MEGASCALE_PORT),
        "MEGASCALE_NUM_SLICES": str(num_slices),
        "MEGASCALE_SLICE_ID": str(slice_id),
    }


def job_environment(*, num_workers: int, coordinator: str, port: int, run_id: str) -> dict:
    """The variables every worker of the job gets (its ``RANK`` apart): what
    ``tpu_train.distributed`` reads to join the job, one process per host."""
    return {
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "WORLD_SIZE": str(num_workers),
        "MASTER_ADDR": coordinator,
        "MASTER_PORT": str(port),
        # The JAX coordination service listens on MASTER_PORT+1 (tpu_train.distributed.init).
        "TPU_TRAIN_JAX_COORDINATOR": f"{coordinator}:{port + 1}",
        "TPU_TRAIN_RUN_ID": run_id,
        # On a TPU host a missing libtpu must stop the run, not move it to the host CPU.
        "TPU_TRAIN_PLATFORM": "tpu",
        "PYTHONUNBUFFERED": "1",  # logs stream as they are written
    }


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        print(f"{PROG}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(prog=PROG, description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("tpu_name", help="the TPU VM slice (gcloud compute tpus tpu-vm list); several "
        "slices of one job: their names, comma-separated, in slice order")
    add("command", help="the command every worker runs, one quoted string")
    add("--zone", help="gcloud zone (default: gcloud's compute/zone)")
    add("--project", help="gcloud project (default: gcloud's project)")
    add("--internal-ip", action="store_true", help="reach the workers by internal IP")
    add("--port", type=int, default=DEFAULT_PORT, help="MASTER_PORT on worker 0 (port+1: JAX's)")
    add("--run-id", help="the job's id (default: UTC time and the launcher's process id)")
    add("--coordinator-ip", help="(slice 0's) worker 0's internal IP (skips the gcloud look-up)")
    add("--num-workers", type=int, help="the worker count of each slice (skips the look-up)")
    add("--workdir", default="tpu_train", help="work directory on every worker, relative to "
        "the login directory or absolute (default: tpu_train)")
    add("--source", default=".", help="the checkout to sync (default: the current directory)")
    add("--no-sync", action="store_true", help="use the code already in --workdir")
    add("--python", default="python3", help="interpreter that creates the workers' .venv")
    add("--setup", help="setup command run once per worker in --workdir (default: .venv with "
        "CPU torch and the [tpu] extra)")
    add("--no-setup", action="store_true", help="skip the setup step")
    add("--env", action="append", default=[], metavar="KEY=VALUE",
        help="another variable for the command (repeatable; overrides the job's own)")
    add("--log-dir", help="local directory for worker-<i>.log")
    add("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    add("--dry-run", action="store_true", help="print every command per worker, run none")
    args = parser.parse_args(argv)
    _validate(parser, args)
    return args


def _validate(parser, args) -> None:
    if not 0 < args.port < 65535:
        parser.error(f"--port must be 1-65534, got {args.port}")
    if args.num_workers is not None and args.num_workers < 1:
        parser.error(f"--num-workers must be a positive integer, got {args.num_workers}")
    args.tpu_names = [name.strip() for name in args.tpu_name.split(",")]
    bad = [name for name in args.tpu_names if not _NAME.fullmatch(name)]
    if bad or len(set(args.tpu_names)) != len(args.tpu_names):
        parser.error(f"TPU_NAME must be one TPU name or several distinct ones, comma-separated "
                     f"(one per slice), got {args.tpu_name!r}")
    args.run_id = args.run_id or time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + \
        f"-{os.getpid() % 0x10000:04x}"
    if not _NAME.fullmatch(args.run_id):
        parser.error(f"--run-id may hold only letters, digits, '.', '_', '-', got {args.run_id!r}")
    for item in args.env:
        key, sep, _ = item.partition("=")
        if not sep or not _ENV_KEY.fullmatch(key):
            parser.error(f"--env needs KEY=VALUE with KEY a variable name, got {item!r}")
    args.workdir = args.workdir[2:] if args.workdir.startswith("~/") else args.workdir
    if not args.workdir or "\n" in args.workdir:
        parser.error("--workdir must be a directory path")
    if not args.no_sync and not Path(args.source, "pyproject.toml").is_file():
        parser.error(f"--source {args.source!r} is not a tpu_train checkout (no pyproject.toml): "
                     f"run from the checkout, pass --source, or --no-sync")
    if not args.command.strip():
        parser.error("the command is empty")


def run_dir_of(command: str, run_id: str) -> str | None:
    """The ``run.dir=...`` the command sets (``$TPU_TRAIN_RUN_ID`` filled in), or None when it
    sets none, one only the worker's shell could work out, or a URL (not a local directory)."""
    found = re.search(r"(?:^|\s)run\.dir=(\S+)", command)
    if not found:
        return None
    value = found.group(1).strip("'\"")
    for name in ("${TPU_TRAIN_RUN_ID}", "$TPU_TRAIN_RUN_ID"):
        value = value.replace(name, run_id)
    local = "://" not in value
    return None if "$" in value or "`" in value or value == "latest" or not local else value


# --- the commands -------------------------------------------------------------------------

class Commands:
    """Every gcloud command of one launch, per worker."""

    def __init__(self, args, bundle: str):
        self.args, self.bundle = args, bundle
        self.remote_bundle = f".tpu_train-{args.run_id}.tar.gz"  # in the login directory
        self.pid_file = f"{STATE_DIR}/{args.run_id}.pgid"
        self.workers_per_slice = 1  # set once the slices are known

    def host(self, rank: int) -> tuple[str, int]:
        """The TPU name and worker index of the job's worker ``rank`` (slice after slice)."""
        return self.args.tpu_names[rank // self.workers_per_slice], rank % self.workers_per_slice

    def _gcloud(self, verb: str, rank: int, *rest: str) -> list[str]:
        args = self.args
        worker = self.host(rank)[1]
        command = ["gcloud", "compute", "tpus", "tpu-vm", verb, *rest, f"--worker={worker}"]
        command += [f"--zone={args.zone}"] if args.zone else []
        command += [f"--project={args.project}"] if args.project else []
        command += ["--internal-ip"] if args.internal_ip else []
        return command

    def ssh(self, worker: int, script: str) -> list[str]:
        return self._gcloud("ssh", worker, self.host(worker)[0], "--command", script)

    def describe(self, tpu_name: str) -> list[str]:
        args = self.args
        command = ["gcloud", "compute", "tpus", "tpu-vm", "describe", tpu_name,
                   "--format=value(networkEndpoints[].ipAddress)"]
        command += [f"--zone={args.zone}"] if args.zone else []
        return command + ([f"--project={args.project}"] if args.project else [])

    def sync(self, worker: int) -> list[list[str]]:
        workdir = shlex.quote(self.args.workdir)
        unpack = (f"mkdir -p {workdir} && tar -xzf {self.remote_bundle} -C {workdir} && "
                  f"rm -f {self.remote_bundle}")
        return [self._gcloud("scp", worker, self.bundle,
                             f"{self.host(worker)[0]}:{self.remote_bundle}"),
                self.ssh(worker, unpack)]

    def setup_command(self) -> str:
        if self.args.setup:
            return self.args.setup
        python = shlex.quote(self.args.python)
        return (f"{python} -m venv .venv && .venv/bin/pip install -q --upgrade pip && "
                f".venv/bin/pip install -q \"$(grep -m1 ^torch== constraints.txt)\" "
                f"--index-url {CPU_TORCH_INDEX} && "
                f".venv/bin/pip install -q -c constraints.txt -e \".[tpu]\"")

    def setup(self, worker: int) -> list[list[str]]:
        command = self.setup_command()
        digest = hashlib.sha256(command.encode()).hexdigest()[:16]
        script = (
            f"cd {shlex.quote(self.args.workdir)} && "
            f"stamp=\"$( (cat pyproject.toml constraints.txt 2>/dev/null; echo {digest}) | "
            f"sha256sum | cut -c1-64)\" && "
            f"if [ \"$(cat {SETUP_STAMP} 2>/dev/null)\" = \"$stamp\" ]; then "
            f"echo \"setup: up to date\"; else ( {command} ) && mkdir -p .venv && "
            f"echo \"$stamp\" > {SETUP_STAMP}; fi")
        return [self.ssh(worker, script)]

    def launch(self, worker: int, env: dict) -> list[list[str]]:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        # The command runs as the leader of a new process group whose id it records first,
        # so that teardown() can stop it and everything it started.
        inner = (f"echo $$ > {self.pid_file}; trap \"rm -f {self.pid_file}\" EXIT; "
                 f"{self._log_beside_run(worker)}{self.args.command}")
        script = (f"cd {shlex.quote(self.args.workdir)} && mkdir -p {STATE_DIR} && "
                  f"export {exports} && "
                  f"if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi && "
                  f"exec setsid --wait bash -c {shlex.quote(inner)}")
        return [self.ssh(worker, script)]

    def _log_beside_run(self, worker: int) -> str:
        """When the command sets ``run.dir``: the shell's output from here on also appended to
        ``<run.dir>/workers/worker-<i>.log`` on the worker (all workers' logs together when the
        run directory is on storage the workers share)."""
        run_dir = run_dir_of(self.args.command, self.args.run_id)
        if run_dir is None:
            return ""
        workers = shlex.quote(f"{run_dir}/workers")
        return f"mkdir -p {workers} && exec > >(tee -a {workers}/worker-{worker}.log) 2>&1; "

    def teardown(self, worker: int) -> list[str]:
        grace = max(1, int(round(self.args.grace)))
        script = (
            f"cd {shlex.quote(self.args.workdir)} 2>/dev/null && f={self.pid_file} && "
            f"if [ -f $f ]; then g=$(cat $f); kill -TERM -- -$g 2>/dev/null; "
            f"for i in $(seq {grace}); do kill -0 -- -$g 2>/dev/null || break; sleep 1; done; "
            f"kill -KILL -- -$g 2>/dev/null; rm -f $f; echo \"stopped process group $g\"; fi; true")
        return self.ssh(worker, script)


def worker_env(args, rank: int, num_workers: int, coordinator: str) -> dict:
    """Worker ``rank``'s variables; ``num_workers`` counts the workers of every slice."""
    env = {"RANK": str(rank), **job_environment(num_workers=num_workers, coordinator=coordinator,
                                                 port=args.port, run_id=args.run_id)}
    num_slices = len(args.tpu_names)
    if num_slices > 1:
        per_slice = num_workers // num_slices if isinstance(num_workers, int) else 1
        env |= slice_environment(num_slices=num_slices, slice_id=rank // per_slice,
                                 coordinator=coordinator)
    env.update(item.split("=", 1) for item in args.env)
    return env


# --- the checkout -------------------------------------------------------------------------

class LaunchError(RuntimeError):
    """Something the user can fix, reported as one line."""


def checkout_files(source: Path) -> list[str]:
    """The files to sync: in a git checkout, the tracked ones and the untracked ones git does
    not ignore (no virtual environments, run directories or caches); elsewhere, every file
    outside ``.git``, ``.venv``, ``runs`` and caches."""
    if (source / ".git").exists():
        try:
            listed = subprocess.run(
                ["git", "-C", str(source), "ls-files", "-z", "--cached", "--others",
                 "--exclude-standard"], capture_output=True, check=True, timeout=120).stdout
        except (OSError, subprocess.SubprocessError) as error:
            raise LaunchError(f"cannot list the files of the checkout {source} with git "
                              f"({error}); pass --no-sync and put the code on the workers "
                              f"yourself") from None
        names = sorted({name for name in listed.decode().split("\0") if name})
        return [name for name in names if (source / name).is_file()]
    found = []
    for folder, subfolders, files in os.walk(source):
        subfolders[:] = sorted(d for d in subfolders if d not in _SKIPPED_WITHOUT_GIT)
        found += [os.path.relpath(os.path.join(folder, f), source) for f in sorted(files)]
    return found


def pack(source: Path, files: list[str], bundle: str) -> None:
    with tarfile.open(bundle, "w:gz") as tar:
        for name in files:
            tar.add(source / name, arcname=name, recursive=False)


def find_workers(args, commands: Commands) -> tuple[str, int]:
    """Slice 0's worker 0's internal IP (the coordinator) and the worker count of each slice,
    from the TPUs' network endpoints (one per worker) unless both were given."""
    if args.coordinator_ip and args.num_workers:
        return args.coordinator_ip, args.num_workers
    counts, coordinator = [], None
    for name in args.tpu_names:
        ips = _worker_ips(name, commands)
        counts.append(len(ips))
        coordinator = coordinator or ips[0]
    if len(set(counts)) > 1:
        raise LaunchError(f"the slices {args.tpu_name!r} have different worker counts {counts}: "
                          f"one job needs slices of one type")
    return args.coordinator_ip or coordinator, args.num_workers or counts[0]


def _worker_ips(tpu_name: str, commands: Commands) -> list[str]:
    try:
        done = subprocess.run(commands.describe(tpu_name), capture_output=True, text=True,
                              timeout=300)
    except FileNotFoundError:
        raise LaunchError("gcloud is not installed or not on PATH (the Google Cloud CLI)") from None
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise LaunchError(f"could not describe TPU {tpu_name!r} (check the name, --zone and "
                          f"--project): {reason}")
    ips = [ip for ip in re.split(r"[;,\s]+", done.stdout.strip()) if ip]
    if not ips:
        raise LaunchError(f"TPU {tpu_name!r} reports no workers")
    return ips


# --- running the steps --------------------------------------------------------------------

class Job:
    """One command list per worker, all workers at once; stops everything on the first failure
    or on a signal."""

    def __init__(self, log_dir: Path, num_workers: int):
        self.logs = [open(log_dir / f"worker-{i}.log", "a", encoding="utf-8", errors="replace")
                     for i in range(num_workers)]
        self.signal: int | None = None
        self._stopping = False
        self._procs: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        for log in self.logs:
            log.close()

    def run_step(self, step: str, per_worker: list[list[list[str]]], echo: int | None = None,
                 timeout: float | None = None) -> tuple[int, int] | None:
        """None when every worker's commands succeeded, else ``(worker, exit status)`` of the
        first failure (status ``128+N`` for signal N received by the launcher)."""
        codes: dict[int, int] = {}
        self._stopping, self._procs = False, {}
        threads = [threading.Thread(target=self._worker, args=(i, step, cmds, codes, echo),
                                    daemon=True) for i, cmds in enumerate(per_worker)]
        for thread in threads:
            thread.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        failure = None
        while any(t.is_alive() for t in threads):
            failed = sorted((i, c) for i, c in list(codes.items()) if c != 0)
            if failed or self.signal is not None or (deadline and time.monotonic() > deadline):
                failure = failed[0] if failed else (-1, 128 + (self.signal or signal.SIGALRM))
                self._kill_all()
                break
            time.sleep(0.1)
        for thread in threads:
            # A reader whose process is gone ends at once; one still blocked after the kill
            # (output held open elsewhere) is left behind: it is a daemon thread.
            thread.join(timeout=None if failure is None else 10.0)
        if failure is None:
            failed = sorted((i, c) for i, c in codes.items() if c != 0)
            failure = failed[0] if failed else None
        return failure

    def _worker(self, index, step, commands, codes, echo) -> None:
        log = self.logs[index]
        for command in commands:
            log.write(f"== {PROG} {step}: {shlex.join(command)}\n")
            log.flush()
            with self._lock:
                if self._stopping:
                    codes[index] = 128 + (self.signal or signal.SIGTERM)
                    return
                try:
                    proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
                except OSError as error:
                    log.write(f"{PROG}: cannot run {command[0]}: {error}\n")
                    codes[index] = 127
                    return
                self._procs[index] = proc
            for raw in proc.stdout:
                line = raw.decode("utf-8", errors="replace")
                log.write(line)
                log.flush()
                if index == echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            code = proc.wait()
            if code != 0:
                codes[index] = code if code > 0 else 128 - code
                return
        codes[index] = 0

    def _kill_all(self) -> None:
        """The local gcloud processes (each the leader of its own session): SIGTERM, SIGKILL
        after 5 s. Remote processes outlive them; see :meth:`Commands.teardown`."""
        with self._lock:
            self._stopping = True
            live = [p for p in self._procs.values() if p.poll() is None]
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            for proc in live:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(p.poll() is None for p in live):
                time.sleep(0.05)
            live = [p for p in live if p.poll() is None]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])
    except OSError:
        return ""


# --- the launcher -------------------------------------------------------------------------

def print_dry_run(args, commands: Commands, coordinator, num_workers, log_dir: Path) -> None:
    lines = []
    workers = range(num_workers) if isinstance(num_workers, int) else [0]
    if not isinstance(num_workers, int):
        lines += ["# look-up of worker 0's IP and the worker count N of each slice",
                  *(shlex.join(commands.describe(name)) for name in args.tpu_names),
                  "# worker 0 stands for all below (--coordinator-ip and --num-workers skip "
                  "the look-up and list every worker)"]
    lines.append(f"# {PROG}: run {args.run_id} on {num_workers} worker(s) of {args.tpu_name}, "
                 f"coordinator {coordinator}:{args.port}; logs in {log_dir}")
    if not args.no_sync:
        count = len(checkout_files(Path(args.source)))
        lines.append(f"# pack {count} files of {Path(args.source).resolve()} into {commands.bundle}")
    for worker in workers:
        env = worker_env(args, worker, num_workers, coordinator)
        for step, skip, step_commands in (
                ("sync", args.no_sync, lambda: commands.sync(worker)),
                ("setup", args.no_setup, lambda: commands.setup(worker)),
                ("launch", False, lambda: commands.launch(worker, env))):
            if not skip:
                tpu, index = commands.host(worker)
                lines.append(f"# worker {worker}: {step} ({tpu} worker {index})")
                lines += [shlex.join(c) for c in step_commands()]
    for worker in workers:
        lines.append(f"# worker {worker}: teardown (on Ctrl-C or when a worker fails)")
        lines.append(shlex.join(commands.teardown(worker)))
    print("\n".join(lines))


def run(args, commands: Commands, coordinator: str, num_workers: int, log_dir: Path) -> int:
    job = Job(log_dir, num_workers)
    previous = {s: signal.signal(s, lambda signum, frame: setattr(job, "signal", signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        steps = []
        if not args.no_sync:
            source = Path(args.source)
            pack(source, checkout_files(source), commands.bundle)
            steps.append(("sync", [commands.sync(w) for w in range(num_workers)]))
        if not args.no_setup:
            steps.append(("setup", [commands.setup(w) for w in range(num_workers)]))
        steps.append(("launch", [commands.launch(w, worker_env(args, w, num_workers, coordinator))
                                 for w in range(num_workers)]))
        for step, per_worker in steps:
            started = time.monotonic()
            failure = job.run_step(step, per_worker, echo=0 if step == "launch" else None)
            if failure is not None:
                return _stop_job(args, commands, job, step, failure, log_dir, num_workers)
            print(f"{PROG}: {step} done on {num_workers} worker(s) in "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        job.close()
        if os.path.exists(commands.bundle):
            os.remove(commands.bundle)


def _stop_job(args, commands, job, step, failure, log_dir, num_workers) -> int:
    worker, code = failure
    if job.signal is not None:
        print(f"{PROG}: got signal {job.signal} during {step}; stopping the job on every worker",
              file=sys.stderr, flush=True)
    else:
        log = log_dir / f"worker-{worker}.log"
        print(f"{PROG}: worker {worker} failed in {step} (exit status {code}); stopping the job "
              f"on every worker. Its log, {log}, ends:\n{_tail(log)}", file=sys.stderr, flush=True)
    if step == "launch":
        job.signal = None  # a second Ctrl-C interrupts the teardown itself
        job.run_step("teardown", [[commands.teardown(w)] for w in range(num_workers)],
                     timeout=args.grace + 120)
    return code


def main(argv=None) -> int:
    args = parse_args(argv)
    bundle = os.path.join(tempfile.gettempdir(), f"tpu_train-{args.run_id}.tar.gz")
    commands = Commands(args, bundle)
    log_dir = Path(args.log_dir or Path("runs", "pod", args.run_id, "workers"))
    try:
        num_slices = len(args.tpu_names)
        if args.dry_run:
            known = args.coordinator_ip and args.num_workers
            commands.workers_per_slice = args.num_workers if known else 1
            unknown = "N" if num_slices == 1 else f"{num_slices}*N"
            print_dry_run(args, commands, args.coordinator_ip or "WORKER0_IP",
                          num_slices * args.num_workers if known else unknown, log_dir)
            return 0
        coordinator, commands.workers_per_slice = find_workers(args, commands)
        num_workers = num_slices * commands.workers_per_slice
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise LaunchError(f"cannot create the log directory {log_dir} ({error.strerror}); "
                              f"pass --log-dir") from None
        print(f"{PROG}: run {args.run_id} on {num_workers} worker(s) of {args.tpu_name}, "
              f"coordinator {coordinator}:{args.port}; logs in {log_dir}",
              file=sys.stderr, flush=True)
        return run(args, commands, coordinator, num_workers, log_dir)
    except LaunchError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
