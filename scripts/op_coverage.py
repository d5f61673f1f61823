#!/usr/bin/env python
"""Sweep PyTorch's OpInfo database (``op_db``) on the tpu device against CPU PyTorch.

Prints one JSON line: number of op_db entries, forward pass count and rate, gradient pass count
and rate (with ``--grad``), time taken, torch and jax versions.

    python scripts/op_coverage.py                       # forward, float32, 3 samples per op
    python scripts/op_coverage.py --grad --samples 5 --json-out /tmp/ops.json
    python scripts/op_coverage.py --grad --write-known-failures   # refresh the CI list
    python scripts/op_coverage.py --samples 1 --eager-mode fused  # the same in fused eager mode

``--ops add sin ...`` restricts the sweep to some entries (``name`` or ``name.variant``).
See docs/op_coverage.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TPU_TRAIN_PLATFORM", "cpu")

KNOWN_FAILURES = ROOT / "tests" / "ops" / "opinfo_known_failures.json"


def worker(dtype_name: str, samples: int, grad: bool) -> int:
    """Child process: read op keys on stdin, print ``START key`` then the result as JSON."""
    import torch

    from tests.ops import opinfo_harness as harness

    ops = {harness.op_key(op): op for op in harness.all_ops()}
    dtype = getattr(torch, dtype_name)
    for line in sys.stdin:
        key = line.strip()
        print("START " + key, flush=True)
        result = harness.run_op(ops[key], dtype, samples=samples, grad=grad)
        print("RESULT " + json.dumps(result.to_json()), flush=True)
    return 0


def isolated_sweep(keys, dtype_name: str, samples: int, grad: bool, progress):
    """Run the ops in a child process; an op that kills it (a native abort) is a failure, and a
    fresh child carries on with the next op."""
    import subprocess

    from tests.ops import opinfo_harness as harness

    results, pending = [], list(keys)
    while pending:
        cmd = [sys.executable, __file__, "--worker", "--dtype", dtype_name,
               "--samples", str(samples)] + (["--grad"] if grad else [])
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 cwd=ROOT)
        child.stdin.write("".join(k + "\n" for k in pending))
        child.stdin.close()
        current = None
        for line in child.stdout:
            if line.startswith("START "):
                current = line[6:].strip()
            elif line.startswith("RESULT "):
                result = harness.Result(**json.loads(line[7:]))
                results.append(result)
                progress(result)
                pending.remove(result.op)
                current = None
        rc = child.wait()
        if current is not None:
            result = harness.Result(current, "fail", f"process died (exit status {rc})")
            results.append(result)
            progress(result)
            pending.remove(current)
        elif pending and rc != 0:
            raise RuntimeError(f"worker exited with status {rc} before starting an op")
    order = {k: i for i, k in enumerate(keys)}
    return sorted(results, key=lambda r: order[r.op])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", help="torch dtype name (default float32)")
    parser.add_argument("--grad", action="store_true", help="also compare input gradients")
    parser.add_argument("--samples", type=int, default=None,
                        help="samples per op (default: the harness's, 3)")
    parser.add_argument("--ops", nargs="*", default=None, help="only these op keys")
    parser.add_argument("--json-out", type=Path, default=None, help="write per-op results here")
    parser.add_argument("--write-known-failures", action="store_true",
                        help=f"write the failing op keys to {KNOWN_FAILURES.relative_to(ROOT)}")
    parser.add_argument("--verbose", "-v", action="store_true", help="one line per op on stderr")
    parser.add_argument("--eager-mode", choices=("strict", "fused"), default=None,
                        help="run the tpu side in this eager mode (default: TPU_TRAIN_EAGER_MODE,"
                             " else strict)")
    parser.add_argument("--in-process", action="store_true",
                        help="no child process (faster start; a native crash ends the sweep)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.eager_mode:  # read at import by this process and by the worker processes
        os.environ["TPU_TRAIN_EAGER_MODE"] = args.eager_mode
    if args.worker:
        return worker(args.dtype, args.samples, args.grad)

    start = time.perf_counter()
    import jax
    import torch

    from tests.ops import opinfo_harness as harness

    dtype = getattr(torch, args.dtype)
    samples = args.samples if args.samples is not None else harness.DEFAULT_SAMPLES
    ops = harness.all_ops()
    if args.ops:
        wanted = set(args.ops)
        ops = [op for op in ops if harness.op_key(op) in wanted or op.name in wanted]

    def progress(result):
        if args.verbose:
            print(f"{result.status:4} {result.op} {result.seconds}s {result.error}",
                  file=sys.stderr, flush=True)

    def run(grad):
        if args.in_process:
            return harness.sweep(ops, dtype, samples=samples, grad=grad, progress=progress)
        return isolated_sweep([harness.op_key(op) for op in ops], args.dtype, samples, grad,
                              progress)

    forward = run(False)
    forward_time = time.perf_counter() - start
    grads = run(True) if args.grad else None

    fsum = harness.summarize(forward)
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
    if grads is not None:
        gsum = harness.summarize(grads)
        summary.update({
            "grad_pass": gsum["pass"],
            "grad_fail": gsum["fail"],
            "grad_skip": gsum["skip"],
            "grad_pass_rate": gsum["pass_rate"],
            "grad_pass_rate_tested": gsum["pass_rate_tested"],
        })
    summary.update({
        "forward_seconds": round(forward_time, 1),
        "seconds": round(time.perf_counter() - start, 1),
        "torch": torch.__version__,
        "jax": jax.__version__,
        "platform": jax.default_backend(),
        "eager_mode": os.environ.get("TPU_TRAIN_EAGER_MODE") or "strict",
    })

    if args.json_out is not None:
        per_op = {"summary": summary, "forward": [r.to_json() for r in forward]}
        if grads is not None:
            per_op["grad"] = [r.to_json() for r in grads]
        args.json_out.write_text(json.dumps(per_op, indent=1) + "\n")

    if args.write_known_failures:
        if args.ops or args.dtype != "float32" or summary["eager_mode"] != "strict":
            parser.error("--write-known-failures needs the full float32 sweep in strict mode")
        known = {
            "comment": "op_db entries (name or name.variant) failing on the tpu device in float32 "
                       "on the first `samples` samples; tests/ops/test_opinfo.py runs the same "
                       "sweep. Regenerate: python scripts/op_coverage.py --samples N --grad "
                       "--write-known-failures",
            "samples": samples,
            "forward": sorted(r.op for r in forward if r.status == "fail"),
        }
        if grads is not None:
            known["grad"] = sorted(r.op for r in grads if r.status == "fail")
        elif KNOWN_FAILURES.exists():
            previous = json.loads(KNOWN_FAILURES.read_text())
            if "grad" in previous and previous.get("samples") == samples:
                known["grad"] = previous["grad"]
        KNOWN_FAILURES.write_text(json.dumps(known, indent=1) + "\n")

    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
