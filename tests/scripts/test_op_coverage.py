"""scripts/op_coverage.py's child processes: an op that crashes its child or runs past the
deadline is a failure and a fresh child carries on; outputs land where asked."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("op_coverage", ROOT / "scripts" / "op_coverage.py")
op_coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(op_coverage)

# A stand-in for the worker (no torch, no device): "hang" sleeps past any deadline, "crash"
# (or $FAKE_CRASH) ends the process as a native abort would, anything else passes; with
# $FAKE_FAILED_STARTS the first two starts fail (a device not yet released).
FAKE_WORKER = """
import json, os, sys, time
starts = os.environ.get("FAKE_FAILED_STARTS")  # a file counting starts that fail
if starts and len(open(starts).read()) < 2:
    open(starts, "a").write("x")
    sys.exit(1)
print("PLATFORM fake", flush=True)
for line in sys.stdin:
    key = line.strip()
    print("START " + key, flush=True)
    if key == "hang":
        time.sleep(60)
    if key in ("crash", os.environ.get("FAKE_CRASH")):
        os._exit(3)
    for what in sys.argv[1:]:
        print(f"RESULT {what} " + json.dumps({"op": key, "status": "pass"}), flush=True)
"""


def _sweep(keys, shard_size=0, grad=False):
    """(the sweep, its forward results, every (what, result) reported as it came)."""
    seen = []
    whats = ["forward", "grad"] if grad else ["forward"]
    sweep = op_coverage.IsolatedSweep("float32", 1, grad, lambda *report: seen.append(report),
                                      op_timeout=2.0, shard_size=shard_size,
                                      command=[sys.executable, "-c", FAKE_WORKER, *whats])
    return sweep, sweep.run(keys)["forward"], seen


@pytest.mark.parametrize("shard_size", [0, 2])
def test_a_crash_and_a_hang_are_failures_and_the_sweep_carries_on(shard_size):
    keys = ["add", "crash", "sin", "hang", "cos"]
    sweep, results, seen = _sweep(keys, shard_size)
    assert [r.op for r in results] == keys  # in the order asked, whichever child ran them
    assert {r.op: r.status for r in results} == {"add": "pass", "crash": "fail", "sin": "pass",
                                                "hang": "fail", "cos": "pass"}
    errors = {r.op: r.error for r in results}
    assert errors["crash"] == "process died (exit status 3)"
    assert errors["hang"] == "timed out after 2 s (killed)"
    assert len(seen) == len(keys) and sweep.platform == "fake"


def test_with_gradients_each_op_gets_both_results_and_a_crash_fails_both():
    keys = ["add", "crash", "sin"]
    sweep, forward, seen = _sweep(keys, grad=True)
    grads = sweep.results["grad"]
    assert [(r.op, r.status) for r in forward] == [("add", "pass"), ("crash", "fail"),
                                                   ("sin", "pass")]
    assert sorted((r.op, r.status) for r in grads) == [("add", "pass"), ("crash", "fail"),
                                                       ("sin", "pass")]
    assert [what for what, _ in seen] == ["forward", "grad"] * 3


def test_a_worker_that_fails_to_start_is_started_again_then_given_up(tmp_path, monkeypatch):
    monkeypatch.setattr(op_coverage, "START_RETRY_PAUSE", 0.0)
    counter = tmp_path / "starts"
    counter.write_text("")
    monkeypatch.setenv("FAKE_FAILED_STARTS", str(counter))
    _, results, _ = _sweep(["add", "sin"])  # two failed starts, then a child that runs both
    assert [(r.op, r.status) for r in results] == [("add", "pass"), ("sin", "pass")]
    counter.write_text("")
    monkeypatch.setattr(op_coverage, "START_RETRIES", 1)
    with pytest.raises(op_coverage.WorkerStartError, match="before starting an op"):
        _sweep(["add"])


def test_options_that_cannot_work_are_one_line_errors(capsys):
    for argv in (["--op-timeout", "0"], ["--shard-size", "-1"],
                 ["--write-known-failures", "--ops", "add"]):
        with pytest.raises(SystemExit) as stopped:
            op_coverage.parse_args(argv)
        assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--op-timeout must be > 0" in err and "needs the full float32 sweep" in err


def test_parts_cover_every_entry_once_and_a_merge_joins_them(tmp_path, monkeypatch):
    """Three parts run (by the fake worker) and merged: one sweep, with the platform's list of
    known failures written where the platform's lists are kept."""
    from tests.ops import opinfo_harness as harness

    every = [harness.op_key(op) for op in harness.all_ops()]
    parts = [op_coverage.select_ops(op_coverage.parse_args(["--part", f"{k}/3"]))
             for k in (1, 2, 3)]
    assert [harness.op_key(op) for part in parts for op in part] == every
    monkeypatch.setattr(op_coverage, "KNOWN_FAILURES_DIR", tmp_path / "lists")
    crashing = harness.op_key(parts[1][-1])
    monkeypatch.setenv("FAKE_CRASH", crashing)
    for k, ops in enumerate(parts, start=1):
        _, results, _ = _sweep([harness.op_key(op) for op in ops])
        swept = {"forward": results, "grad": None, "not_run": {"forward": []}, "platform": "fake",
                 "forward_seconds": 1.0, "seconds": 1.0}
        args = op_coverage.parse_args(["--samples", "1", "--part", f"{k}/3",
                                       "--out-dir", str(tmp_path / "parts")])
        op_coverage.write_outputs(args, op_coverage.summarize(args, 1, swept), swept, 1)
    assert op_coverage.main(["--merge", str(tmp_path / "parts"), "--write-known-failures",
                             "--out-dir", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "op_coverage-fake-float32-strict.json").read_text())
    assert [r["op"] for r in merged["forward"]] == every
    assert merged["summary"]["forward_fail"] == 1 and merged["summary"]["total"] == len(every)
    known = json.loads((tmp_path / "lists" / "fake.json").read_text())
    assert known["forward"] == [crashing] and known["samples"] == 1
    assert (tmp_path / "merged" / "opinfo_known_failures" / "fake.json").read_text() == \
        (tmp_path / "lists" / "fake.json").read_text()


def test_a_merge_with_entries_missing_writes_no_list(tmp_path, capsys):
    args = op_coverage.parse_args(["--part", "1/3", "--out-dir", str(tmp_path)])
    _, results, _ = _sweep(["add"])
    swept = {"forward": results, "grad": None, "not_run": {"forward": ["sin"]},
             "platform": "fake", "forward_seconds": 1.0, "seconds": 1.0}
    op_coverage.write_outputs(args, op_coverage.summarize(args, 1, swept), swept, 1)
    with pytest.raises(SystemExit) as stopped:
        op_coverage.main(["--merge", str(tmp_path), "--write-known-failures"])
    assert stopped.value.code == 2
    assert "entries have no result (" in capsys.readouterr().err
