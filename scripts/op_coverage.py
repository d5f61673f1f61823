#!/usr/bin/env python
"""Sweep PyTorch's OpInfo database (``op_db``) on the tpu device against CPU PyTorch.

Prints one JSON line: number of op_db entries, forward pass count and rate, gradient pass count
and rate (with ``--grad``), time taken, torch and jax versions.

    python scripts/op_coverage.py                       # forward, float32, 3 samples per op
    python scripts/op_coverage.py --grad --samples 5 --json-out /tmp/ops.json
    python scripts/op_coverage.py --grad --write-known-failures   # refresh the CI list
    python scripts/op_coverage.py --samples 1 --eager-mode fused  # the same in fused eager mode
    TPU_TRAIN_PLATFORM=tpu python scripts/op_coverage.py --samples 1 --grad --part 3/12 \
        --out-dir DIR                                   # one twelfth of the entries, on a chip
    python scripts/op_coverage.py --merge DIR --write-known-failures   # the parts, as one sweep

``--ops add sin ...`` restricts the sweep to some entries (``name`` or ``name.variant``).
The tpu side runs on the platform ``TPU_TRAIN_PLATFORM`` names (cpu unless set), in child
processes (``--shard-size`` ops each); an op that crashes its child or runs past
``--op-timeout`` seconds is a failure, and a fresh child carries on. This process never opens
the device: one process at a time can hold a TPU chip. ``--part K/N`` runs the K-th of N equal
slices of the entries and ``--budget`` starts no op after that many seconds (the rest are
listed as not run), so that a sweep fits the time a host gives one command; ``--merge`` joins
the parts. The known failures are kept per platform, tests/ops/opinfo_known_failures/
<platform>.json. See docs/op_coverage.md.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PLATFORM = os.environ.setdefault("TPU_TRAIN_PLATFORM", "cpu").strip().lower()

KNOWN_FAILURES_DIR = ROOT / "tests" / "ops" / "opinfo_known_failures"
# What a worker may take to start (import torch, JAX and op_db, open the device) before its
# first op, whatever --op-timeout says.
START_UP_SECONDS = 600.0
START_RETRIES, START_RETRY_PAUSE = 2, 5.0


def known_failures_path(platform: str) -> Path:
    return KNOWN_FAILURES_DIR / f"{platform}.json"


def worker(dtype_name: str, samples: int, grad: bool) -> int:
    """Child process: say the platform, then read op keys on stdin and print ``START key``, then
    ``RESULT forward <json>`` (and with ``grad`` ``RESULT grad <json>``: right after the
    forward, so that the op's executables compiled for it are still at hand)."""
    import torch

    from tests.ops import opinfo_harness as harness
    from tpu_train.device import runtime

    print("PLATFORM " + runtime.platform(), flush=True)
    ops = {harness.op_key(op): op for op in harness.all_ops()}
    dtype = getattr(torch, dtype_name)
    for line in sys.stdin:
        key = line.strip()
        print("START " + key, flush=True)
        for what in ("forward", "grad") if grad else ("forward",):
            result = harness.run_op(ops[key], dtype, samples=samples, grad=what == "grad")
            print(f"RESULT {what} " + json.dumps(result.to_json()), flush=True)
    return 0


def _pump(stream, lines: queue.Queue) -> None:
    """Hands a child's output lines to the sweep, then None at its end (a thread, so that
    the sweep can wait with a deadline)."""
    for line in stream:
        lines.put(line)
    lines.put(None)


class WorkerStartError(RuntimeError):
    pass


class IsolatedSweep:
    """Runs ops in child processes, ``shard_size`` per child (0: all in one), forward and, with
    ``grad``, gradients. An op that kills its child (a native abort) or runs past
    ``op_timeout`` seconds (the child is killed) fails what it had not finished, and a fresh
    child carries on with the next op."""

    def __init__(self, dtype_name: str, samples: int, grad: bool, progress, *,
                 op_timeout: float, shard_size: int, stop_at: float | None = None,
                 command: list[str] | None = None):
        self.command = command or [sys.executable, __file__, "--worker", "--dtype", dtype_name,
                                   "--samples", str(samples)] + (["--grad"] if grad else [])
        self.progress, self.op_timeout, self.shard_size = progress, op_timeout, shard_size
        self.stop_at = stop_at  # time.monotonic() after which no op starts
        self.whats = ("forward", "grad") if grad else ("forward",)
        self.platform = None
        self.results = {what: [] for what in self.whats}
        self.not_run: list[str] = []

    def run(self, keys: list[str]) -> dict[str, list]:
        """{"forward": results[, "grad": results]} in the order of ``keys``; the keys not
        started before ``stop_at`` are left in ``not_run``."""
        pending, failed_starts = list(keys), 0
        while pending and not self._out_of_time():
            shard = pending[:self.shard_size] if self.shard_size > 0 else list(pending)
            try:
                finished = self._run_child(shard)
            except WorkerStartError:
                # A chip is released a moment after the process that held it ends (an op
                # killed just before): try again before giving up.
                failed_starts += 1
                if failed_starts > START_RETRIES:
                    raise
                time.sleep(START_RETRY_PAUSE)
                continue
            failed_starts = 0
            for key in finished:
                pending.remove(key)
        self.not_run = pending
        order = {k: i for i, k in enumerate(keys)}
        return {what: sorted(results, key=lambda r: order[r.op])
                for what, results in self.results.items()}

    def _out_of_time(self) -> bool:
        return self.stop_at is not None and time.monotonic() >= self.stop_at

    def _record(self, what: str, result) -> None:
        self.results[what].append(result)
        self.progress(what, result)

    def _fail_unfinished(self, key: str, error: str) -> None:
        from tests.ops import opinfo_harness as harness

        for what in self.whats:
            if not any(r.op == key for r in self.results[what]):
                self._record(what, harness.Result(key, "fail", error))

    def _run_child(self, shard: list[str]) -> list[str]:
        """The keys of ``shard`` that got their results (all, or up to one that ended the
        child)."""
        from tests.ops import opinfo_harness as harness

        child = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, cwd=ROOT,
                                 env={**os.environ, "TPU_TRAIN_PLATFORM": PLATFORM})
        child.stdin.write("".join(k + "\n" for k in shard))
        child.stdin.close()
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True).start()
        done, current, started = [], None, time.monotonic()
        while True:
            # An op gets op_timeout; a child starting up (or between ops) at least START_UP_SECONDS.
            allowed = self.op_timeout if current else max(self.op_timeout, START_UP_SECONDS)
            try:
                line = lines.get(timeout=max(0.0, started + allowed - time.monotonic()))
            except queue.Empty:
                child.kill()
                child.wait()
                if current is None:
                    raise RuntimeError(f"the worker printed nothing for {allowed:g} s (its "
                                       f"start-up hung, or another process holds the device)"
                                       ) from None
                self._fail_unfinished(current, f"timed out after {self.op_timeout:g} s (killed)")
                return done + [current]
            if line is None:
                break
            if line.startswith("PLATFORM "):
                self.platform = line[9:].strip()
                started = time.monotonic()
            elif line.startswith("START "):
                if self._out_of_time():  # this op and the rest of the shard are not run
                    child.kill()
                    child.wait()
                    return done
                current, started = line[6:].strip(), time.monotonic()
            elif line.startswith("RESULT "):
                what, payload = line[7:].split(" ", 1)
                result = harness.Result(**json.loads(payload))
                self._record(what, result)
                if what == self.whats[-1]:
                    done.append(result.op)
                    current, started = None, time.monotonic()
        rc = child.wait()
        if current is not None:
            self._fail_unfinished(current, f"process died (exit status {rc})")
            return done + [current]
        if not done and shard:
            raise WorkerStartError(f"worker exited with status {rc} before starting an op")
        return done  # a child that ended between ops leaves the rest to a fresh one


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", help="torch dtype name (default float32)")
    parser.add_argument("--grad", action="store_true", help="also compare input gradients")
    parser.add_argument("--samples", type=int, default=None,
                        help="samples per op (default: the harness's, 3)")
    parser.add_argument("--ops", nargs="*", default=None, help="only these op keys")
    parser.add_argument("--part", default=None, metavar="K/N",
                        help="only the K-th of N equal slices of the entries (1 <= K <= N)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="start no op after this many seconds; the rest are listed as not run")
    parser.add_argument("--json-out", type=Path, default=None, help="write per-op results here")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="write the summary and per-op results (and, with "
                             "--write-known-failures, a copy of the list) under this directory")
    parser.add_argument("--write-known-failures", action="store_true",
                        help="write the failing op keys to tests/ops/opinfo_known_failures/"
                             "<platform>.json (the list of the platform the ops ran on)")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, metavar="PATH",
                        help="join --part results (files, or directories holding them) into "
                             "one sweep instead of running ops")
    parser.add_argument("--verbose", "-v", action="store_true", help="one line per op on stderr")
    parser.add_argument("--eager-mode", choices=("strict", "fused"), default=None,
                        help="run the tpu side in this eager mode (default: TPU_TRAIN_EAGER_MODE,"
                             " else strict)")
    parser.add_argument("--in-process", action="store_true",
                        help="no child process (faster start; a native crash ends the sweep)")
    parser.add_argument("--op-timeout", type=float, default=600.0,
                        help="seconds one op may take in its child process before it is killed "
                             "and counted a failure (default 600)")
    parser.add_argument("--shard-size", type=int, default=0,
                        help="ops per child process; a fresh child after each shard (default 0: "
                             "one child, replaced only when an op ends it)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


def _check_args(parser, args) -> None:
    if args.op_timeout <= 0 or args.shard_size < 0:
        parser.error(f"--op-timeout must be > 0 and --shard-size >= 0 (got {args.op_timeout:g}, "
                     f"{args.shard_size})")
    if args.budget is not None and (args.budget <= 0 or args.in_process):
        parser.error("--budget must be > 0 seconds, and works with child processes (no "
                     "--in-process)")
    if args.part is not None:
        try:
            k, n = (int(x) for x in args.part.split("/"))
            if not 1 <= k <= n:
                raise ValueError
        except ValueError:
            parser.error(f"--part {args.part!r}: give K/N with 1 <= K <= N, e.g. --part 3/12")
        args.part = (k, n)
    mode = args.eager_mode or os.environ.get("TPU_TRAIN_EAGER_MODE") or "strict"
    if args.write_known_failures and not args.merge and (
            args.ops or args.part or args.budget or args.dtype != "float32" or mode != "strict"):
        parser.error("--write-known-failures needs the full float32 sweep in strict mode (no "
                     "--ops, --part or --budget; join parts with --merge)")


def select_ops(args) -> list:
    from tests.ops import opinfo_harness as harness

    ops = harness.all_ops()
    if args.ops:
        wanted = set(args.ops)
        ops = [op for op in ops if harness.op_key(op) in wanted or op.name in wanted]
    if args.part:
        k, n = args.part
        ops = ops[(k - 1) * len(ops) // n:k * len(ops) // n]
    return ops


def sweep_both(args, ops, dtype, samples) -> dict:
    """Forward (and with --grad gradient) results, what was not run, the platform and times."""
    from tests.ops import opinfo_harness as harness

    def progress(what, result):
        if args.verbose:
            print(f"{what:7} {result.status:4} {result.op} {result.seconds}s {result.error}",
                  file=sys.stderr, flush=True)

    start = time.monotonic()
    if args.in_process:
        from tpu_train.device import runtime

        swept = {"platform": runtime.platform(), "not_run": {}, "grad": None}
        for what in ("forward", "grad") if args.grad else ("forward",):
            swept[what] = harness.sweep(ops, dtype, samples=samples, grad=what == "grad",
                                        progress=lambda result, what=what: progress(what, result))
    else:
        isolated = IsolatedSweep(args.dtype, samples, args.grad, progress,
                                 op_timeout=args.op_timeout, shard_size=args.shard_size,
                                 stop_at=None if args.budget is None else start + args.budget)
        swept = {"grad": None, **isolated.run([harness.op_key(op) for op in ops])}
        swept["platform"] = isolated.platform
        swept["not_run"] = {what: list(isolated.not_run) for what in isolated.whats}
    # Forward and gradient checks of an op alternate in one child: each's time is its own sum.
    swept["forward_seconds"] = sum(r.seconds for r in swept["forward"])
    swept["seconds"] = time.monotonic() - start
    return swept


def summarize(args, samples, swept: dict) -> dict:
    import jax
    import torch

    from tests.ops import opinfo_harness as harness

    fsum = harness.summarize(swept["forward"])
    summary = {
        "dtype": args.dtype,
        "samples_per_op": samples,
        "total": fsum["total"],
        "forward_pass": fsum["pass"],
        "forward_fail": fsum["fail"],
        "forward_skip": fsum["skip"],
        "forward_pass_rate": fsum["pass_rate"],
        "forward_pass_rate_tested": fsum["pass_rate_tested"],
    }
    if swept["grad"] is not None:
        gsum = harness.summarize(swept["grad"])
        summary.update({
            "grad_pass": gsum["pass"],
            "grad_fail": gsum["fail"],
            "grad_skip": gsum["skip"],
            "grad_pass_rate": gsum["pass_rate"],
            "grad_pass_rate_tested": gsum["pass_rate_tested"],
        })
    summary.update({
        "not_run": sum(len(keys) for keys in swept["not_run"].values()),
        "part": "/".join(map(str, args.part)) if args.part else None,
        "forward_seconds": round(swept["forward_seconds"], 1),
        "seconds": round(swept["seconds"], 1),
        "torch": torch.__version__,
        "jax": jax.__version__,
        # From the process that ran the ops: this one never opens the device.
        "platform": swept["platform"] or PLATFORM,
        "eager_mode": os.environ.get("TPU_TRAIN_EAGER_MODE") or "strict",
    })
    return summary


def known_failures(platform: str, samples: int, forward, grads) -> dict:
    known = {
        "comment": f"op_db entries (name or name.variant) failing on the tpu device on the "
                   f"{platform} platform in float32 on the first `samples` samples; "
                   f"tests/ops/test_opinfo.py runs the same sweep. Regenerate: "
                   f"TPU_TRAIN_PLATFORM={platform} python scripts/op_coverage.py --samples N "
                   f"--grad --write-known-failures",
        "samples": samples,
        "forward": sorted(r.op for r in forward if r.status == "fail"),
    }
    path = known_failures_path(platform)
    if grads is not None:
        known["grad"] = sorted(r.op for r in grads if r.status == "fail")
    elif path.exists():
        previous = json.loads(path.read_text())
        if "grad" in previous and previous.get("samples") == samples:
            known["grad"] = previous["grad"]
    return known


def write_outputs(args, summary, swept: dict, samples) -> None:
    per_op = {"summary": summary, "forward": [r.to_json() for r in swept["forward"]]}
    if swept["grad"] is not None:
        per_op["grad"] = [r.to_json() for r in swept["grad"]]
    per_op["not_run"] = swept["not_run"]
    targets = [args.json_out] if args.json_out is not None else []
    if args.out_dir is not None:
        part = f"-part{args.part[0]}of{args.part[1]}" if args.part else ""
        name = f"op_coverage-{summary['platform']}-{args.dtype}-{summary['eager_mode']}{part}.json"
        targets.append(args.out_dir / name)
    for path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(per_op, indent=1) + "\n")
    if args.write_known_failures:
        platform = summary["platform"]
        text = json.dumps(known_failures(platform, samples, swept["forward"], swept["grad"]),
                          indent=1) + "\n"
        copies = [known_failures_path(platform)]
        if args.out_dir is not None:
            copies.append(args.out_dir / "opinfo_known_failures" / f"{platform}.json")
        for path in copies:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def _fail(message: str):
    print(f"op_coverage.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _part_files(paths: list[Path]) -> list[Path]:
    files = []
    for path in paths:
        if path.is_dir():
            files += sorted(path.rglob("op_coverage-*-part*of*.json"))
        elif path.is_file():
            files.append(path)
        else:
            _fail(f"--merge {path}: no such file or directory")
    if not files:
        _fail(f"--merge: no op_coverage-*-part*of*.json files in {' '.join(map(str, paths))}")
    return files


def merge(args) -> int:
    """Joins the results of --part runs (one sweep's parts) into one sweep's outputs."""
    from tests.ops import opinfo_harness as harness

    files = _part_files(args.merge)
    parts = [json.loads(path.read_text()) for path in files]
    first = parts[0]["summary"]
    same = ("platform", "dtype", "eager_mode", "samples_per_op")
    for path, part in zip(files, parts):
        other = {k: part["summary"][k] for k in same}
        if any(first[k] != v for k, v in other.items()):
            _fail(f"--merge: {path} is from another sweep ({other}) than {files[0]}")
    has_grad = all("grad" in part for part in parts)
    order = {harness.op_key(op): i for i, op in enumerate(harness.all_ops())}
    swept = {"platform": first["platform"],
             "forward_seconds": sum(part["summary"]["forward_seconds"] for part in parts),
             "seconds": sum(part["summary"]["seconds"] for part in parts)}
    for what in ("forward", "grad") if has_grad else ("forward",):
        results = [harness.Result(**r) for part in parts for r in part[what]]
        keys = [r.op for r in results]
        if len(set(keys)) != len(keys):
            _fail(f"--merge: {what} results for some entries appear twice: "
                  f"{sorted({k for k in keys if keys.count(k) > 1})}")
        swept[what] = sorted(results, key=lambda r: order.get(r.op, len(order)))
    swept.setdefault("grad", None)
    swept["not_run"] = {what: sorted({k for part in parts for k in part["not_run"].get(what, ())}
                                     | (set(order) - {r.op for r in swept[what]}),
                                     key=order.get)
                        for what in ("forward", "grad") if swept[what] is not None}
    missing = sorted({k for keys in swept["not_run"].values() for k in keys}, key=order.get)
    if args.write_known_failures and missing:
        _fail(f"--merge: {len(missing)} entries have no result ({' '.join(missing[:20])}"
              f"{' ...' if len(missing) > 20 else ''}): run them with --ops and merge again")
    args.dtype, args.part = first["dtype"], None
    os.environ["TPU_TRAIN_EAGER_MODE"] = first["eager_mode"]
    summary = summarize(args, first["samples_per_op"], swept)
    write_outputs(args, summary, swept, first["samples_per_op"])
    print(json.dumps(summary), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.eager_mode:  # read at import by this process and by the worker processes
        os.environ["TPU_TRAIN_EAGER_MODE"] = args.eager_mode
    if args.worker:
        return worker(args.dtype, args.samples, args.grad)
    if args.merge:
        return merge(args)
    if not args.in_process:
        # This process computes only the CPU side and must never open the chip its workers
        # use (one process at a time can open a TPU), whatever the libraries it imports ask
        # of the tpu device (OpInfo's import asks whether it is available).
        os.environ["TPU_TRAIN_PLATFORM"] = "cpu"

    import torch

    from tests.ops import opinfo_harness as harness

    dtype = getattr(torch, args.dtype)
    samples = args.samples if args.samples is not None else harness.DEFAULT_SAMPLES
    swept = sweep_both(args, select_ops(args), dtype, samples)
    summary = summarize(args, samples, swept)
    write_outputs(args, summary, swept, samples)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
