"""The compiled step's XLA compile runs ahead, while the starting model is validated: the same
program, the same results, and its errors raised by the first step as before."""

from __future__ import annotations

import json
import re
import threading

import pytest

from tests.trainer.cli_helpers import TINY_COMPILED, assert_one_line_out_of_memory, run_in_process
from tpu_train.compile import ProgramOutOfMemoryError
from tpu_train.compile.cache import CompileCache, Signature
from tpu_train.trainer import loop

GiB = 2**30
# Validation at the start and after the last step (loss and exact match, decoded on the device).
VALIDATED = [*TINY_COMPILED, "trainer.max_steps=3", "trainer.val_every_n_steps=3",
             "trainer.val_at_start=true", "recipe.eval.exact_match_examples=8",
             "recipe.eval.max_new_tokens=4"]


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def _figures(run_dir) -> list[tuple]:
    """Every train and validation figure of the run, in order, as written (step, key, value)."""
    return [(r["step"], key, value) for r in _records(run_dir) for key, value in sorted(r.items())
            if key.startswith(("train/loss", "train/grad_norm", "train/lr", "val/"))]


# The train step's compile event in train.log (tpu_train.trainer.summary.describe_compilation):
# compiled, or loaded from the persistent compilation cache, which a test session on a chip
# keeps (tests/conftest.py): there the second run's program is the first one's.
_COMPILE_LINE = re.compile(r"(compiled|loaded) the train step (from the compilation cache )?in ")


def _compile_lines(run_dir) -> list[str]:
    return [line for line in (run_dir / "train.log").read_text().splitlines()
            if _COMPILE_LINE.search(line)]


def test_compiling_ahead_gives_the_same_run(tmp_path, monkeypatch):
    from tpu_train.compile import CompiledDecoder

    started, compile_ahead = [], CompiledDecoder.compile_ahead

    def decoding_ahead(self, *args, **kwargs):
        started.append(compile_ahead(self, *args, **kwargs))
        return started[-1]

    monkeypatch.setattr(CompiledDecoder, "compile_ahead", decoding_ahead)
    code, _, err = run_in_process(*VALIDATED, f"run.dir={tmp_path / 'ahead'}")
    assert code == 0, err
    assert started == [True]  # the first validation's decoding program was compiled ahead
    monkeypatch.setattr(loop._Loop, "compile_ahead", lambda self: None)
    monkeypatch.setattr(loop._Validator, "compile_ahead", lambda self: None)
    code, _, err = run_in_process(*VALIDATED, f"run.dir={tmp_path / 'at_first_step'}")
    assert code == 0, err

    ahead, at_first_step = _figures(tmp_path / "ahead"), _figures(tmp_path / "at_first_step")
    assert {key for _, key, _ in ahead} >= {"train/loss", "val/loss", "val/exact_match"}
    assert [step for step, key, _ in ahead if key == "val/exact_match"] == [0, 3]
    assert ahead == at_first_step  # bitwise: the same program ran on the same batches
    # One compilation each; the first says it was compiled ahead, the second does not.
    [line] = _compile_lines(tmp_path / "ahead")
    assert "first call; compiled ahead, the first step waited " in line, line
    [line] = _compile_lines(tmp_path / "at_first_step")
    assert "compiled ahead" not in line, line


def test_an_out_of_memory_compile_ahead_is_the_first_steps_one_line_error(tmp_path,
                                                                          monkeypatch):
    from tpu_train.compile import train_step

    threads = []

    def too_large(program, stages):
        threads.append(threading.current_thread())
        raise ProgramOutOfMemoryError(int(20 * GiB), int(15.75 * GiB), "hbm",
                                      "RESOURCE_EXHAUSTED")

    monkeypatch.setattr(train_step, "compile_program", too_large)
    code, _, err = run_in_process(*TINY_COMPILED, "trainer.max_steps=2",
                                  f"run.dir={tmp_path / 'run'}")
    assert_one_line_out_of_memory(code, err)
    # It was the compile ahead that failed, on its own thread; the first step raised it.
    assert len(threads) == 1 and threads[0] is not threading.main_thread()


def test_the_cache_waits_for_a_compile_ahead_and_raises_its_error_on_the_caller():
    cache = CompileCache("a program")
    signature = Signature(inputs=(), settings=(("k", 1),))
    release = threading.Event()

    def compile_slowly(lowered, stages):
        release.wait(30)
        return lowered + " compiled"

    def build_at_call(stages):
        raise AssertionError("the compile ahead must be used")

    assert cache.build_ahead(signature, lambda stages: "lowered", compile_slowly)
    assert not cache.build_ahead(signature, lambda stages: "again", compile_slowly)
    threading.Timer(0.2, release.set).start()
    assert cache.get_or_build(signature, build_at_call) == "lowered compiled"
    [record] = cache.records
    assert record.cause == "first call" and record.waited_s >= 0.1

    failing = Signature(inputs=(), settings=(("k", 2),))

    def fail(lowered, stages):
        raise ValueError("XLA said no")

    cache.build_ahead(failing, lambda stages: "lowered", fail)
    with pytest.raises(ValueError, match="XLA said no"):
        cache.get_or_build(failing, build_at_call)
    # After a failed compile ahead the next call builds the program itself.
    assert cache.get_or_build(failing, lambda stages: "built at the call") == "built at the call"
