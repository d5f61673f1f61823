"""Trace + compile time of a compiled Llama step against depth, scanned and unrolled.

Usage: ``python scripts/bench_compile_depth.py [--layers 4 16 32] [--rounds 2] [--dim 512]``.

Each measurement runs in a fresh process (nothing cached: no traced layer body, no XLA
executable, ``TPU_TRAIN_CACHE_DIR=off``) that lowers and compiles the AdamW step of a Llama
(dim 512, 8 heads / 4 kv heads, SwiGLU 1408, vocab 8192, batch 4 x 256, the model on ``meta``:
nothing is allocated) with ``scan_layers`` on and off; the runs are interleaved round by round.
Prints one JSON line: per mode and depth the trace / lower / compile seconds of every round
(fastest and median of their sum), and ``scanned_deepest_over_shallowest`` (fastest sums), the
figure the scan is for: it should stay near 1 while the unrolled ratio grows with depth.
Timings depend on the machine's load: the script records the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r'''
import json, sys, time
import torch
import torch.nn.functional as F
import tpu_train
from tpu_train.compile import lower_train_step
from tpu_train.models import Llama, LlamaConfig

layers, dim, scan = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
cfg = LlamaConfig(dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, vocab_size=8192,
                  ffn_hidden_dim=1408, max_seq_len=256)
with torch.device("meta"):
    model = Llama(cfg)
    batch = {"tokens": torch.empty(4, 256, dtype=torch.int64),
             "labels": torch.empty(4, 256, dtype=torch.int64)}
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

def loss_fn(m, b):
    return F.cross_entropy(m(b["tokens"]).flatten(0, 1), b["labels"].flatten())

start = time.perf_counter()
program = lower_train_step(model, optimizer, loss_fn, batch, scan_layers=scan)
seconds = dict(program.seconds)
seconds["wall"] = time.perf_counter() - start
from tpu_train.device import runtime
seconds["platform"], seconds["device_kind"] = runtime.platform(), runtime.device_kind(0)
print(json.dumps(seconds))
'''


def _measure(layers: int, dim: int, scan: bool) -> dict:
    env = dict(os.environ, TPU_TRAIN_CACHE_DIR="off")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(layers), str(dim),
                           "1" if scan else "0"], capture_output=True, text=True, env=env,
                          timeout=3600)
    if proc.returncode:
        raise SystemExit(f"{layers} layers, scan={scan} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    args = parser.parse_args()
    runs: dict[str, dict[int, list[dict]]] = {"scanned": {}, "unrolled": {}}
    load_before = os.getloadavg()
    started = time.time()
    for _ in range(args.rounds):
        for layers in args.layers:
            for mode in ("scanned", "unrolled"):
                seconds = _measure(layers, args.dim, mode == "scanned")
                runs[mode].setdefault(layers, []).append(seconds)
    first = runs["scanned"][args.layers[0]][0]
    report: dict = {"benchmark": "compile_depth", "dim": args.dim, "rounds": args.rounds,
                    "platform": first["platform"], "device_kind": first["device_kind"],
                    "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
                    "load_before": [round(x, 2) for x in load_before],
                    "load_after": [round(x, 2) for x in os.getloadavg()]}
    for mode, by_depth in runs.items():
        report[mode] = {}
        for layers, rounds in by_depth.items():
            totals = [r["trace"] + r["lower"] + r["compile"] for r in rounds]
            report[mode][str(layers)] = {
                "trace_lower_compile_s": [[round(r[k], 2) for k in ("trace", "lower", "compile")]
                                          for r in rounds],
                "total_fastest_s": round(min(totals), 2),
                "total_median_s": round(statistics.median(totals), 2)}
        shallow, deep = min(by_depth), max(by_depth)
        report[f"{mode}_deepest_over_shallowest"] = round(
            report[mode][str(deep)]["total_fastest_s"]
            / report[mode][str(shallow)]["total_fastest_s"], 2)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
