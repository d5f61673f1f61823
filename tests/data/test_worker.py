"""WorkerPrefetcher: a PackedLoader's batches built in a worker process, exactly as the loader
itself would give them, resumable, its errors raised where the batch was asked for."""

from __future__ import annotations

import itertools
import pickle
import signal
import subprocess
import sys

import pytest
import torch

from tests.processes import process_gone
from tpu_train.data.errors import DataError
from tpu_train.data.packing import PackedLoader
from tpu_train.data.worker import WorkerPrefetcher


@pytest.fixture
def loader(tokenizer, write_jsonl):
    path = write_jsonl([{"prompt": f"question {i}", "response": "x " * (i % 7)} for i in range(60)])

    def make():
        return PackedLoader(path, tokenizer, seq_len=12, batch_size=3, shuffle_buffer=5, seed=2)

    return make


def _same(batch, expected) -> bool:
    return all(torch.equal(batch[key], expected[key]) for key in ("tokens", "labels"))


def test_a_loader_pickles_as_its_settings_and_position(loader):
    original = loader()
    for _ in range(4):
        next(original)
    copy = pickle.loads(pickle.dumps(original))
    for _ in range(6):
        assert _same(next(copy), next(original))


def test_batches_and_resume_match_the_loader(loader):
    """The worker runs ahead (depth 3); the state after the 5th batch consumed continues at the
    6th, in a new prefetcher and after a rewind of the same one."""
    expected = list(itertools.islice(loader(), 14))
    with WorkerPrefetcher(loader(), depth=3) as prefetcher:
        for index in range(5):
            assert _same(next(prefetcher), expected[index])
        state = prefetcher.state_dict()
        assert _same(next(prefetcher), expected[5])
        prefetcher.load_state_dict(state)  # stops the worker; the next batch starts one
        assert not prefetcher.alive()
        for index in range(5, 9):
            assert _same(next(prefetcher), expected[index])
    assert not prefetcher.alive()
    with WorkerPrefetcher(loader(), depth=2) as resumed:
        resumed.load_state_dict(state)
        for index in range(5, 14):
            assert _same(next(resumed), expected[index])


def test_a_bad_record_is_the_loaders_own_error_at_the_same_batch(tokenizer, write_jsonl):
    # 3-token samples: the 2nd read-ahead chunk (line 257 on) is reached by the 3rd batch.
    path = write_jsonl([{"text": "a"}] * 256 + ["{broken"])

    def outcome(batches):
        taken = 0
        try:
            while True:
                next(batches)
                taken += 1
        except DataError as error:
            return taken, str(error)

    direct = outcome(PackedLoader(path, tokenizer, seq_len=32, batch_size=8))
    with WorkerPrefetcher(PackedLoader(path, tokenizer, seq_len=32, batch_size=8)) as worker:
        assert outcome(worker) == direct
        assert f"{path}:257:" in direct[1]
        with pytest.raises(StopIteration):  # the error ended the stream, as a loader's would
            next(worker)


def test_a_finite_loader_ends(tokenizer, write_jsonl):
    path = write_jsonl([{"text": "one two three"}] * 5)

    def make():
        return PackedLoader(path, tokenizer, seq_len=8, batch_size=2, num_epochs=1)

    with WorkerPrefetcher(make(), depth=2) as worker:
        got = list(worker)
    expected = list(make())
    assert len(got) == len(expected) > 0
    assert all(_same(a, b) for a, b in zip(got, expected))


def test_close_ends_the_worker_and_forbids_more(loader):
    prefetcher = WorkerPrefetcher(loader(), depth=1)
    next(prefetcher)
    process = prefetcher._process
    assert prefetcher.alive() and process.poll() is None
    prefetcher.close()
    assert not prefetcher.alive() and process.poll() is not None
    with pytest.raises(RuntimeError, match="closed"):
        next(prefetcher)


@pytest.mark.parametrize("depth", [0, -1, True, 1.5])
def test_depth_must_be_a_positive_integer(loader, depth):
    with pytest.raises(ValueError, match="prefetch depth must be >= 1"):
        WorkerPrefetcher(loader(), depth=depth)


_ABANDON = """
import sys
from tpu_train.data import PackedLoader, load_tokenizer
from tpu_train.data.worker import WorkerPrefetcher
prefetcher = WorkerPrefetcher(PackedLoader(sys.argv[1], load_tokenizer(), 8, 2), depth=2)
next(prefetcher)
print(prefetcher._process.pid, flush=True)
if sys.argv[2] == "hang":
    sys.stdin.read()
"""


@pytest.mark.parametrize("how", ["exit", "killed"])
def test_the_worker_ends_with_the_training_process(write_jsonl, how):
    """An unclosed prefetcher does not hold up the interpreter's exit, and a training process
    killed outright (SIGKILL: no atexit) leaves no worker behind."""
    path = write_jsonl([{"text": "one two three four"}] * 50)
    child = subprocess.Popen([sys.executable, "-c", _ABANDON, str(path),
                              "hang" if how == "killed" else "exit"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    worker_pid = int(child.stdout.readline())
    if how == "killed":
        child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=60) == (-signal.SIGKILL if how == "killed" else 0)
    assert process_gone(worker_pid, within=10)
