"""Does the prefetcher overlap the host-to-device transfer with the step?

Exact command (from the repository root)::

    python scripts/bench_prefetch.py            # --batches 40 --step-ms 20 --transfer-ms 15 --repeats 5

A fake training step (``--step-ms``) consumes batches whose transfer takes ``--transfer-ms``
(a sleep wrapped around the real ``.to(device, non_blocking=True)``). Without prefetching an
epoch costs about ``batches * (step + transfer)``; with it, about ``batches * max(step,
transfer)``. The two modes run interleaved ``--repeats`` times in one process (timings on a
shared machine swing), and one JSON line reports min and median seconds per mode next to both
predictions, plus the fraction of the transfer time hidden.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tpu_train.data.prefetch import DevicePrefetcher, move_batch  # noqa: E402


def batches(n: int):
    for i in range(n):
        yield {"tokens": torch.full((8, 512), i, dtype=torch.long), "labels": torch.full((8, 512), i, dtype=torch.long)}


def run(n: int, step_s: float, transfer_s: float, device: torch.device, prefetch: bool) -> float:
    def slow_transfer(batch):
        time.sleep(transfer_s)
        return move_batch(batch, device)

    start = time.perf_counter()
    if prefetch:
        with DevicePrefetcher(batches(n), device, depth=2, transfer=slow_transfer) as loader:
            for batch in loader:
                time.sleep(step_s)
    else:
        for batch in batches(n):
            batch = slow_transfer(batch)
            time.sleep(step_s)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description="Prefetching vs none with a slow step and a slow transfer.")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--transfer-ms", type=float, default=15.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    step_s, transfer_s = args.step_ms / 1000, args.transfer_ms / 1000

    times: dict[str, list[float]] = {"none": [], "prefetch": []}
    for _ in range(args.repeats):
        for mode in ("none", "prefetch"):
            times[mode].append(run(args.batches, step_s, transfer_s, device, mode == "prefetch"))

    serial = args.batches * (step_s + transfer_s)
    overlapped = args.batches * max(step_s, transfer_s) + min(step_s, transfer_s)
    hidden = (statistics.median(times["none"]) - statistics.median(times["prefetch"])) / (args.batches * transfer_s)
    print(
        json.dumps(
            {
                "bench": "prefetch",
                "device": str(device),
                "batches": args.batches,
                "step_ms": args.step_ms,
                "transfer_ms": args.transfer_ms,
                "repeats": args.repeats,
                "none_s": {"min": round(min(times["none"]), 3), "median": round(statistics.median(times["none"]), 3)},
                "prefetch_s": {
                    "min": round(min(times["prefetch"]), 3),
                    "median": round(statistics.median(times["prefetch"]), 3),
                },
                "predicted_serial_s": round(serial, 3),
                "predicted_overlapped_s": round(overlapped, 3),
                "transfer_hidden_fraction": round(hidden, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
