"""Bus bandwidth of the tpu ProcessGroup vs torch's gloo ProcessGroup, in one run.

    python scripts/bench_collectives.py            # 2 and 4 local processes, 1-64 MB
    python scripts/bench_collectives.py --worlds 2 --sizes-mb 1 16

all_reduce, all_gather and reduce_scatter of float32 tensors; tpu-group timings use tpu tensors
(the CPU PJRT client here), gloo timings use CPU tensors, in the same processes and interleaved
repetition by repetition (tpu, tpu_native, gloo, tpu, ...), so that all see the same machine
load; ``tpu_native`` is the same group with XLA's own psum/psum_scatter (what TPUs and GPUs run)
instead of the CPU client's formulations (host_transport.py, collectives.py). Bus bandwidth follows the usual convention: all_reduce moves 2(n-1)/n of the
buffer per rank, all_gather and reduce_scatter (n-1)/n of the full buffer. Prints ONE JSON line
with the median and min over the repetitions (rank 0's clock; a barrier precedes each timing)
and the 1-minute load average before and after each world; ``--table`` also prints a Markdown
table (min / median ms, ratio of the medians tpu/gloo).

Unlike the other benchmarks it always runs on the PJRT CPU client (``TPU_TRAIN_PLATFORM=cpu``
for its processes): it starts several processes on one host, and on an accelerator each would
need chips of its own; gloo, its yardstick, is a CPU transport anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _collective(op, full, part, group, sync):
    import torch
    import torch.distributed as dist

    def once():
        if op == "all_reduce":
            dist.all_reduce(full, group=group)
        elif op == "all_gather":
            dist.all_gather_into_tensor(full, part, group=group)
        else:
            dist.reduce_scatter_tensor(part, full, group=group)
        if sync:  # the tpu collective is asynchronous: wait for its result
            torch.tpu.synchronize()

    return once


# "tpu": the group as it runs (on the CPU client: all-reduce over torch's gloo from staging
# buffers, reduce-scatter as an exchange of chunks + local reduction); "tpu_native": XLA's own
# psum / psum_scatter on the same group, what TPUs and GPUs run; "gloo": torch's gloo group on
# CPU tensors.
BACKENDS = ("tpu", "tpu_native", "gloo")


def _native(run, group):
    """``run`` with XLA's own collectives: psum_scatter, and psum instead of the host gloo."""
    def once():
        saved = group._mesh.exchange_scatter, group._host
        group._mesh.exchange_scatter, group._host = False, None
        try:
            run()
        finally:
            group._mesh.exchange_scatter, group._host = saved

    return once


def worker(sizes_mb, reps):
    import torch
    import torch.distributed as dist

    import tpu_train  # noqa: F401
    import tpu_train.distributed  # noqa: F401

    dist.init_process_group("tpu")
    n, rank = dist.get_world_size(), dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    tpu_group = dist.distributed_c10d._get_default_group()
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
              "reduce_scatter": (n - 1) / n}
    rows = []
    for mb in sizes_mb:
        numel = int(mb * 2**20 // 4)
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            runs = {}
            for backend in BACKENDS:
                device, group = ("cpu", gloo) if backend == "gloo" else ("tpu", None)
                full = torch.ones(numel, device=device)
                part = torch.ones(numel // n, device=device)
                runs[backend] = _collective(op, full, part, group, device == "tpu")
                if backend == "tpu_native":
                    runs[backend] = _native(runs[backend], tpu_group)
                runs[backend]()  # compile / warm up
            times = {backend: [] for backend in BACKENDS}
            for _ in range(reps):
                for backend in BACKENDS:
                    dist.barrier(group=gloo)
                    start = time.perf_counter()
                    runs[backend]()
                    times[backend].append(time.perf_counter() - start)
            nbytes = numel * 4
            for backend, ts in times.items():
                median = statistics.median(ts)
                rows.append({"op": op, "backend": backend, "world": n, "mb": mb,
                             "median_ms": 1e3 * median, "min_ms": 1e3 * min(ts),
                             "busbw_gbps_median": factor[op] * nbytes / median / 1e9})
    if rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--table", action="store_true", help="also print a Markdown table")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.sizes_mb, args.reps)
    rows, load = [], {}
    env = dict(os.environ, PYTHONPATH=str(ROOT), TPU_TRAIN_PLATFORM="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    for world in args.worlds:
        before = os.getloadavg()[0]
        out = subprocess.run(
            [sys.executable, "-m", "tpu_train.distributed.launch", "--nproc", str(world),
             __file__, "--worker", "--reps", str(args.reps), "--sizes-mb",
             *map(str, args.sizes_mb)], env=env, cwd=ROOT, capture_output=True, text=True,
            timeout=1200)
        line = next((l for l in out.stdout.splitlines() if l.startswith("ROWS ")), None)
        if line is None:
            raise SystemExit(f"world {world} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        rows += json.loads(line[5:])
        load[world] = [round(before, 2), round(os.getloadavg()[0], 2)]
    import jax
    import torch

    print(json.dumps({"benchmark": "collectives", "platform": "cpu (PJRT CPU client + gloo)",
                      "cpus": os.cpu_count(), "torch": torch.__version__, "jax": jax.__version__,
                      "reps": args.reps, "load_1min_before_after": load, "rows": rows}))
    if args.table:
        print(_table(rows, load))


def _table(rows, load) -> str:
    cell = {(r["world"], r["mb"], r["op"], r["backend"]): r for r in rows}
    ops = ("all_reduce", "reduce_scatter", "all_gather")
    lines = ["| world | MB | " + " | ".join(f"{op} tpu / tpu_native / gloo (ratios to gloo)"
                                           for op in ops) + " |",
             "|---|---|" + "---|" * len(ops)]
    for world, mb in sorted({(r["world"], r["mb"]) for r in rows}):
        cells = []
        for op in ops:
            tpu, native, gloo = (cell[(world, mb, op, b)] for b in BACKENDS)
            cells.append(f"{tpu['min_ms']:.3g}/{tpu['median_ms']:.3g}, "
                         f"{native['min_ms']:.3g}/{native['median_ms']:.3g} vs "
                         f"{gloo['min_ms']:.3g}/{gloo['median_ms']:.3g} "
                         f"({tpu['median_ms'] / gloo['median_ms']:.2f}x, "
                         f"{native['median_ms'] / gloo['median_ms']:.2f}x)")
        lines.append(f"| {world} | {mb:g} | " + " | ".join(cells) + " |")
    loads = ", ".join(f"{w} procs {b}->{a}" for w, (b, a) in load.items())
    return "\n".join(lines) + f"\n\nms min/median; load average (1 min) {loads}"


if __name__ == "__main__":
    main()
