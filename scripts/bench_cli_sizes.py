#!/usr/bin/env python
"""What the user runs against what the benchmark measures: ``tpu-train`` on a benchmark size's
model option against ``scripts/bench_train_step.py --size``'s compiled step, same size, same
chip.

For ``--size S`` (``w1``, ``350m``, ``1b``: ``scripts/jax_llama.py`` SIZES), each round runs,
one after the other in child processes (one process at a time can hold a TPU chip):

* the benchmark: ``bench_train_step.py --size S --only compiled --steps M`` (its median step
  over steps 2..M, tokens/s, MFU);
* the command line::

      tpu-train recipe=llama_pretrain model=llama_S data=synthetic_tokens trainer.max_steps=N

  with only what does not touch a step added (a temporary ``run.dir``, no Hugging Face export,
  one checkpoint, after the last step), read back from the run's ``metrics.jsonl``:
  ``throughput/*``, the figures of its closing block (median step over the steps that compiled
  nothing, tokens/s and MFU at it, and the wall-clock rate after the first step, which
  includes the trainer's own work between steps: logging, metrics, the data); beside them the
  whole process's seconds (``process_s``) and its closing block's ``checkpoint saves`` row.

Both sides time a step the same way: from the step call until its loss has been read on the
host (the benchmark: ``train_step_modes.wait_for_loss``; the loop: its ``float`` of the loss and
gradient norm, which arrive in the same transfer), so the median steps compare like for like.

Prints ONE JSON line: both sides' figures (the median over rounds of each round's median),
``cli_over_bench`` (tokens/s at the median step, and by the wall clock, over the benchmark's),
``within_5_percent`` (the median-step ratio is >= 0.95), and ``settings_differ``: the trainer,
optimizer and parallel settings, and the batch, in which the command's composed config differs
from the one the benchmark's step is built from (empty when the comparison is like for like;
the lr schedule is not compared: the lr is an input of the compiled program). Exit status 1
when a side failed (its ``error`` holds the end of its output), or ran past ``--timeout``
seconds. Usage::

    python scripts/bench_cli_sizes.py --size w1|350m|1b [--steps N] [--bench-steps M]
                                      [--rounds R] [--timeout S]

Runs on the best platform present (a TPU, else the CPU; ``TPU_TRAIN_PLATFORM`` chooses), as
both children do.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIZES = ("w1", "350m", "1b")
# Trainer settings that do not shape the step: how long, which seed, validation (the synthetic
# source has none), the time limit.
NOT_COMPARED = {"max_steps", "seed", "val_every_n_steps", "val_at_start", "val_batches",
                "max_minutes"}
TAIL = 4000  # characters of a failed child's output kept in the report
# Seconds between two children: a TPU chip has refused a program started just after another
# one had released it.
PAUSE_S = 5.0


def cli_overrides(size: str, steps: int, run_dir: str) -> list[str]:
    """The command's overrides: the user's command, then what only keeps the run small."""
    import train_step_modes as tsm

    user = ["recipe=llama_pretrain", f"model={tsm.model_option(size)}", "data=synthetic_tokens",
            f"trainer.max_steps={steps}"]
    housekeeping = [f"run.dir={run_dir}", "checkpoint.export_hf=false",
                    f"checkpoint.every_n_steps={steps}"]
    return user + housekeeping


def _child(command: list[str], timeout_s: float) -> subprocess.CompletedProcess | dict:
    """The finished child, or the report's error entry when it failed or ran out of time."""
    time.sleep(PAUSE_S)
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        output = "".join(part.decode() if isinstance(part, bytes) else part or ""
                         for part in (exc.stdout, exc.stderr))
        return {"error": f"stopped after {timeout_s:g} s (--timeout)",
                "output_tail": output[-TAIL:]}
    if proc.returncode != 0:
        return {"error": f"exit status {proc.returncode}",
                "output_tail": (proc.stdout + proc.stderr)[-TAIL:]}
    return proc


def run_bench(size: str, steps: int, timeout_s: float) -> dict:
    """``bench_train_step.py --size size --only compiled``'s report, or an error."""
    proc = _child([sys.executable, str(ROOT / "scripts" / "bench_train_step.py"), "--size", size,
                   "--only", "compiled", "--steps", str(steps)], timeout_s)
    if isinstance(proc, dict):
        return proc
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    compiled = report["modes"]["compiled"]
    return {"median_step_s": compiled["median_s"], "fastest_step_s": compiled["fastest_s"],
            "tokens_per_s": compiled["tokens_per_s"], "mfu": compiled["mfu_median"],
            "first_step_s": compiled["first_step_s"], "timed_steps": steps - 1,
            "device": {key: report.get(key) for key in
                       ("platform", "device_kind", "device_count", "peak_bf16_tflops")}}


def read_throughput(run_dir: Path) -> dict:
    """The last ``throughput/*`` row of the run's ``metrics.jsonl`` and step 1's seconds."""
    row, first_step = {}, None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if any(key.startswith("throughput/") for key in record):
            row = {key.split("/", 1)[1]: value for key, value in record.items()
                   if key.startswith("throughput/")}
        if record.get("step") == 1 and "train/step_time_s" in record:
            first_step = record["train/step_time_s"]
    if not row:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no throughput row")
    return {"median_step_s": row["median_step_time_s"], "fastest_step_s": row["fastest_step_time_s"],
            "tokens_per_s": row["tokens_per_s"], "mfu": row.get("mfu"),
            "wall_tokens_per_s": row["wall_tokens_per_s"], "first_step_s": first_step,
            "timed_steps": int(row["timed_steps"])}


def run_cli(size: str, steps: int, timeout_s: float) -> dict:
    """``tpu-train`` on the size's model option (module docstring), or an error."""
    run_dir = Path(tempfile.mkdtemp(prefix="bench_cli_sizes_")) / "run"
    try:
        overrides = cli_overrides(size, steps, str(run_dir))
        start = time.perf_counter()
        proc = _child([sys.executable, "-m", "tpu_train.cli", *overrides], timeout_s)
        if isinstance(proc, dict):
            return proc
        figures = read_throughput(run_dir)
        figures["process_s"] = round(time.perf_counter() - start, 1)
        # What the run's checkpoint save cost (the closing block's row; not part of a step).
        saves = re.search(r"^.*  checkpoint saves: +(.+)$", (run_dir / "train.log").read_text(),
                          flags=re.MULTILINE)
        figures["checkpoint_saves"] = saves.group(1) if saves else None
        return figures
    finally:
        shutil.rmtree(run_dir.parent, ignore_errors=True)


def settings_differ(size: str, steps: int) -> dict:
    """``{key: [command's value, benchmark's value]}`` for the settings that shape the step."""
    from omegaconf import OmegaConf

    import jax_llama
    import train_step_modes as tsm
    from hydra import compose, initialize_config_dir

    from tpu_train.cli import CONFIG_DIR

    bench = tsm.trainer_config("bf16", model=tsm.model_option(size))
    run_dir = tempfile.mkdtemp(prefix="bench_cli_sizes_cfg_")
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cli = compose(config_name="config", overrides=cli_overrides(size, steps, run_dir))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

    def flat(cfg, section: str) -> dict:
        values = OmegaConf.to_container(cfg[section], resolve=True, enum_to_str=True)
        return {f"{section}.{k}": v for k, v in values.items() if k not in NOT_COMPARED}

    differ = {}
    for section in ("trainer", "optim", "parallel"):
        mine, theirs = flat(cli, section), flat(bench, section)
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key):
                differ[key] = [mine.get(key), theirs.get(key)]
    shape = jax_llama.SIZES[size]
    for key, wanted in (("data.batch_size", shape.batch), ("data.seq_len", shape.seq)):
        value = OmegaConf.select(cli, key)
        if value != wanted:
            differ[key] = [value, wanted]
    return differ


def _median_over(rounds: list[dict]) -> dict:
    """Each numeric figure's median over the rounds (the first round's other values)."""
    merged = dict(rounds[0])
    for key, value in rounds[0].items():
        values = [r[key] for r in rounds if isinstance(r.get(key), (int, float))]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and values:
            merged[key] = _rounded(key, statistics.median(values))
    if len(rounds) > 1:
        merged["rounds_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in rounds]
    return merged


def _rounded(key: str, value: float) -> float:
    """Seconds to the microsecond, rates to a tenth, fractions to 4 places."""
    if key.endswith("per_s"):
        return round(value, 1)
    return round(value, 6) if key.endswith("_s") else round(value, 4)




def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=SIZES, required=True)
    parser.add_argument("--steps", type=int, default=30,
                        help="tpu-train's trainer.max_steps (the first step compiles)")
    parser.add_argument("--bench-steps", type=int, default=20,
                        help="bench_train_step.py's --steps (the first step compiles)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="benchmark then command, this many times; figures are medians")
    parser.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                        help="stop a child after S seconds (it is then reported as failed)")
    args = parser.parse_args(argv)
    for name in ("steps", "bench_steps"):
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be >= 2 (the first step compiles and "
                         "is not timed)")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    import jax_llama

    sides: dict[str, list[dict]] = {"bench": [], "cli": []}
    failed = {}
    for _ in range(args.rounds):
        for name, run in (("bench", lambda: run_bench(args.size, args.bench_steps, args.timeout)),
                          ("cli", lambda: run_cli(args.size, args.steps, args.timeout))):
            result = run()
            if "error" in result:
                failed[name] = result
            else:
                sides[name].append(result)
            said = (result["error"] if "error" in result
                    else f"{result['tokens_per_s']:,.1f} tokens/s at the median step")
            print(f"{name}: {said}", file=sys.stderr, flush=True)
        if failed:
            break
    size = jax_llama.SIZES[args.size]
    report = {"size": args.size, "batch": size.batch, "seq": size.seq, "rounds": args.rounds,
              "cli_command": "tpu-train " + " ".join(cli_overrides(args.size, args.steps,
                                                                    "<tmp>")),
              "date": time.strftime("%Y-%m-%d"), "commit": provenance.commit()}
    for name in sides:
        report[name] = failed.get(name) or _median_over(sides[name])
    if not failed:
        report["device"] = report["bench"].pop("device")
        cli, bench = report["cli"], report["bench"]
        ratio = cli["tokens_per_s"] / bench["tokens_per_s"]
        report["cli_over_bench"] = {
            "tokens_per_s": round(ratio, 3),
            "wall_tokens_per_s": round(cli["wall_tokens_per_s"] / bench["tokens_per_s"], 3)}
        report["within_5_percent"] = ratio >= 0.95
    report["settings_differ"] = settings_differ(args.size, args.steps)
    report["failed"] = sorted(failed)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
