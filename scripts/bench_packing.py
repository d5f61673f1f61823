"""Memory and speed of the packing pipeline on a ~1 GB instruction JSONL file.

Exact command (from the repository root)::

    nice python scripts/bench_packing.py            # --size-gb 1.0 --seq-len 2048 --batch-size 8

Writes a synthetic instruction JSONL file of the requested size into a temporary directory
(streamed, never held in memory), packs all of it once through ``PackedLoader`` with the bundled
tokenizer and a shuffle buffer, and prints one JSON line: peak RSS of the process (MB, from
``resource.getrusage``), tokens packed per second, elapsed seconds and the sizes involved.
The target is a peak RSS under 500 MB whatever the file size.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tpu_train.data import PackedLoader, load_tokenizer  # noqa: E402
from tpu_train.data.prose import iter_paragraphs  # noqa: E402
from tpu_train.data.synthetic import iter_examples  # noqa: E402


def write_instruction_file(path: Path, size_bytes: int, seed: int = 0) -> int:
    """Stream instruction records (prose and synthetic-task mixes) until ``size_bytes``; returns lines."""
    rng = random.Random(seed)
    paragraphs = list(itertools.islice(iter_paragraphs(seed), 4000))
    tasks = iter_examples("train", seed)
    written = lines = 0
    with path.open("w", encoding="utf-8") as f:
        while written < size_bytes:
            if rng.random() < 0.5:
                task = next(tasks)
                record = {"prompt": task["prompt"], "response": task["response"]}
            else:
                record = {
                    "instruction": "Continue the story in the same style.",
                    "input": rng.choice(paragraphs),
                    "output": " ".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 3))),
                }
            line = json.dumps(record) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            lines += 1
    return lines


def peak_rss_mb() -> float:
    # ru_maxrss is in kilobytes on Linux (bytes on macOS).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description="Peak RSS and tokens/s of packing a large JSONL file.")
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shuffle-buffer", type=int, default=1000)
    args = parser.parse_args()

    tokenizer = load_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "instructions.jsonl"
        start = time.perf_counter()
        lines = write_instruction_file(path, int(args.size_gb * 1024**3))
        generate_seconds = time.perf_counter() - start
        rss_before_packing = peak_rss_mb()

        loader = PackedLoader(
            path, tokenizer, args.seq_len, args.batch_size, shuffle_buffer=args.shuffle_buffer, num_epochs=1
        )
        tokens = batches = 0
        start = time.perf_counter()
        for batch in loader:
            tokens += batch["tokens"].numel()
            batches += 1
        elapsed = time.perf_counter() - start
        print(
            json.dumps(
                {
                    "bench": "packing",
                    "file_mb": round(path.stat().st_size / 1024**2, 1),
                    "lines": lines,
                    "seq_len": args.seq_len,
                    "batch_size": args.batch_size,
                    "shuffle_buffer": args.shuffle_buffer,
                    "batches": batches,
                    "tokens": tokens,
                    "elapsed_s": round(elapsed, 1),
                    "tokens_per_s": round(tokens / elapsed),
                    "generate_s": round(generate_seconds, 1),
                    "peak_rss_mb_before_packing": round(rss_before_packing, 1),
                    "peak_rss_mb": round(peak_rss_mb(), 1),
                    "target_peak_rss_mb": 500,
                }
            )
        )


if __name__ == "__main__":
    main()
