from __future__ import annotations

import itertools
import subprocess
import sys
import time

import pytest
import torch

from tests.platforms import cpu_child_env
from tpu_train.data import prefetch as prefetch_module
from tpu_train.data.packing import PackedLoader
from tpu_train.data.prefetch import DevicePrefetcher, move_batch


def counting_source(n, log=None):
    for i in range(n):
        if log is not None:
            log.append(i)
        yield {"tokens": torch.full((2, 4), i), "labels": torch.full((2, 4), -i)}


def test_yields_every_batch_in_order_on_the_device():
    with DevicePrefetcher(counting_source(6), "cpu", depth=2) as prefetcher:
        got = [b["tokens"][0, 0].item() for b in prefetcher]
    assert got == list(range(6))


def test_works_with_another_device_type():
    # "meta" is a real torch device with no data: proves nothing assumes CPU or CUDA.
    with DevicePrefetcher(counting_source(2), "meta") as prefetcher:
        batch = next(prefetcher)
    assert batch["tokens"].device.type == "meta" and batch["tokens"].shape == (2, 4)
    nested = move_batch({"a": [torch.ones(1), (torch.zeros(2), "keep")]}, "meta")
    assert nested["a"][0].is_meta and nested["a"][1][0].is_meta and nested["a"][1][1] == "keep"


def test_worker_runs_ahead_by_depth():
    pulled = []
    with DevicePrefetcher(counting_source(20, pulled), "cpu", depth=3) as prefetcher:
        next(prefetcher)
        deadline = time.monotonic() + 5
        while len(pulled) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        # one consumed, three queued, one more held by the worker waiting for space
        assert len(pulled) == 5


def test_exceptions_in_the_worker_reach_the_consumer():
    def failing():
        yield {"tokens": torch.zeros(1)}
        raise KeyError("broken record")

    prefetcher = DevicePrefetcher(failing(), "cpu")
    next(prefetcher)
    with pytest.raises(KeyError, match="broken record"):
        next(prefetcher)
    with pytest.raises(StopIteration):
        next(prefetcher)
    prefetcher.close()


def test_close_stops_a_blocked_worker_promptly():
    prefetcher = DevicePrefetcher(counting_source(10_000), "cpu", depth=1)
    next(prefetcher)
    start = time.monotonic()
    prefetcher.close()
    assert time.monotonic() - start < 2
    assert not prefetcher.alive()
    assert prefetcher._worker.thread.daemon
    with pytest.raises(RuntimeError, match="closed"):
        next(prefetcher)


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        DevicePrefetcher(counting_source(1), "cpu", depth=0)


def test_resume_through_the_prefetcher_does_not_skip_prefetched_batches(tokenizer, write_jsonl):
    path = write_jsonl([{"text": f"sample {i} " + "x " * (i % 5)} for i in range(40)])

    def loader():
        return PackedLoader(path, tokenizer, seq_len=10, batch_size=2, shuffle_buffer=4, seed=1)

    uninterrupted = list(itertools.islice(loader(), 20))
    with DevicePrefetcher(loader(), "cpu", depth=4) as prefetcher:
        for _ in range(7):
            next(prefetcher)
        time.sleep(0.1)  # let the worker fill its queue: the source is now ahead of the consumer
        state = prefetcher.state_dict()

    with DevicePrefetcher(loader(), "cpu", depth=4) as resumed:
        resumed.load_state_dict(state)
        for expected in uninterrupted[7:]:
            assert torch.equal(next(resumed)["tokens"], expected["tokens"])
        # A rewind while the worker runs ahead: it is stopped, and reading starts over there.
        resumed.load_state_dict(state)
        for expected in uninterrupted[7:12]:
            assert torch.equal(next(resumed)["tokens"], expected["tokens"])


def test_abandoned_prefetcher_does_not_block_interpreter_exit():
    # The worker is left blocked on a full queue and never closed: the process must exit cleanly.
    # prefetch.py needs only torch: load it by path so the child skips the package's other imports.
    script = (
        "import importlib.util, sys, torch\n"
        f"spec = importlib.util.spec_from_file_location('prefetch', {prefetch_module.__file__!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "source = ({'tokens': torch.zeros(2)} for _ in iter(int, 1))\n"
        "prefetcher = module.DevicePrefetcher(source, 'cpu', depth=1)\n"
        "next(prefetcher)\n"
        "print('consumed')\n"
    )
    for _ in range(2):  # a crash at exit was intermittent (about one run in two) before the fix
        result = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
            env=cpu_child_env(),  # prefetches to the host CPU: no chip needed
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "consumed"
