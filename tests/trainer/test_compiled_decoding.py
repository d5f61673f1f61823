"""recipe=eval, recipe=generate and validation during training decode with a compiled program
on the tpu device: the same answers as the op-by-op CPU path, one program per run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.cli_helpers import TINY_COMPILED, read_metrics, run_in_process
from tests.trainer.loss_bounds import (GOLDEN_OVERRIDES, assert_base_model_losses_close,
                                       assert_matches_golden)
from tpu_train.trainer import evaluation

BASE = ["model=debug_tiny_base", "trainer.mode=eager"]
COMPILED_MARK = "decoding: compiled on tpu:0, 1 program"


def _after_model_line(out: str) -> list[str]:
    """The recipe's result lines (without the compiled-decoding line)."""
    return [line for line in out.splitlines()[1:] if not line.startswith("decoding:")]


def test_generate_on_tpu_is_compiled_and_matches_the_cpu(one_thread, monkeypatch):
    """Greedy and sampled generation, compiled on the tpu device at the default
    trainer.precision=fp32: its decoding program's matmuls run in float32 (bf16's in
    test_generate_decodes_in_trainer_precision)."""
    dtypes = _decoding_dot_dtypes(monkeypatch)
    prompts = "recipe.generate.prompts=[add 12+30, what is 7 times 6, hello]"
    runs = {device: run_in_process("recipe=generate", *BASE, f"trainer.device={device}",
                                   prompts, "recipe.generate.max_new_tokens=10")
            for device in ("tpu", "cpu")}
    for device, (code, _, err) in runs.items():
        assert code == 0, f"{device}: {err}"
    tpu_out, cpu_out = runs["tpu"][1], runs["cpu"][1]
    assert COMPILED_MARK in tpu_out and "decoding:" not in cpu_out
    assert tpu_out.count("--- prompt:") == 3
    assert _after_model_line(tpu_out) == _after_model_line(cpu_out)  # greedy: same text
    sampled = ["recipe=generate", *BASE, "trainer.device=tpu", prompts,
               "recipe.generate.max_new_tokens=10", "recipe.generate.temperature=1.0",
               "recipe.generate.top_p=0.9"]
    first, again = run_in_process(*sampled), run_in_process(*sampled)
    assert first[0] == 0 and COMPILED_MARK in first[1], first[2]
    assert _after_model_line(first[1]) == _after_model_line(again[1])  # seeded by trainer.seed
    assert dtypes and all(dtype == torch.float32 for dtype in dtypes), dtypes


def test_eval_on_tpu_is_compiled_and_matches_the_cpu(one_thread, monkeypatch):
    """The same data and exact match; the loss (recorded at full precision, its printed figures
    checked against it) within the derived bound of two implementations (on a chip, its XLA's
    functions and debug_tiny_base's one-pass bfloat16 dots against torch's): one batch of
    debug_tiny_base's 16 rows."""
    settings = ["recipe=eval", *BASE, "recipe.eval.batches=1", "recipe.eval.exact_match_examples=40",
                "recipe.eval.max_new_tokens=8"]
    results = []
    mean_loss = evaluation._mean_loss
    monkeypatch.setattr(evaluation, "_mean_loss",
                        lambda *args: results.append(mean_loss(*args)) or results[-1])
    tpu = run_in_process(*settings, "trainer.device=tpu")
    cpu = run_in_process(*settings, "trainer.device=cpu")
    assert tpu[0] == 0 and cpu[0] == 0, tpu[2] + cpu[2]
    assert COMPILED_MARK in tpu[1] and "decoding:" not in cpu[1]
    assert len([line for line in tpu[1].splitlines() if "exact_match" in line]) == 1
    *tpu_lines, tpu_result = _after_model_line(tpu[1])
    *cpu_lines, cpu_result = _after_model_line(cpu[1])
    assert tpu_lines == cpu_lines  # the data
    assert len(results) == 2
    for values, line in zip(results, (tpu_result, cpu_result)):
        printed = f"loss {values['loss']:.4f} | perplexity {values['perplexity']:.4f} | "
        assert line.startswith(printed), (line, values)
    assert tpu_result.split(" | ")[2:] == cpu_result.split(" | ")[2:]  # exact match
    assert_base_model_losses_close([results[0]["loss"]], [results[1]["loss"]], rows=16,
                                   what="eval loss, tpu against cpu")


def test_validation_during_compiled_training_decodes_compiled(tmp_path, one_thread):
    """Four validations (the starting model's and one per step) reuse one program, and the training losses stay those of the golden
    run without validation (decoding reads the weights and draws no random numbers)."""
    run_dir = tmp_path / "run"
    overrides = [o for o in TINY_COMPILED if not o.startswith("trainer.val_every_n_steps")]
    code, out, err = run_in_process(
        "recipe=llama_finetune", *overrides, *GOLDEN_OVERRIDES, "trainer.max_steps=3",
        "trainer.val_every_n_steps=1",
        "recipe.eval.exact_match_examples=8", "recipe.eval.max_new_tokens=4",
        f"run.dir={run_dir}")
    assert code == 0, err
    assert out.count(f"validation {COMPILED_MARK}") == 1
    validations = [line for line in out.splitlines() if "| validation |" in line]
    assert len(validations) == 4 and all("exact_match" in line for line in validations)
    assert validations[0].startswith("step 0/3 | validation | ")
    losses = [read_metrics(run_dir)[step]["train/loss"] for step in (1, 2, 3)]
    golden = json.loads((Path(__file__).parent / "golden" / "llama_finetune.json").read_text())
    assert_matches_golden(losses, golden["losses"], rows=8)  # TINY_COMPILED's 8-row batches


DOTS = ("aten.mm.default", "aten.bmm.default", "aten.addmm.default")


def _decoding_dot_dtypes(monkeypatch) -> list:
    """Records the output dtype of every matmul of the decoding graphs traced from now on."""
    from tpu_train.compile import decoding

    dtypes = []
    original = decoding._trace_step

    def recording(*args, **kwargs):
        gm = original(*args, **kwargs)
        dtypes.extend(node.meta["val"].dtype for node in gm.graph.nodes
                      if node.op == "call_function" and str(node.target) in DOTS)
        return gm

    monkeypatch.setattr(decoding, "_trace_step", recording)
    return dtypes


def test_generate_decodes_in_trainer_precision(monkeypatch, one_thread):
    """recipe=generate with trainer.precision=bf16 runs its compiled decoding program's
    matmuls in bf16 (as validation and the training step do); fp32's run in float32
    (test_generate_on_tpu_is_compiled_and_matches_the_cpu, the same command at fp32)."""
    dtypes = _decoding_dot_dtypes(monkeypatch)
    code, out, err = run_in_process("recipe=generate", *BASE, "trainer.device=tpu",
                                    "trainer.precision=bf16",
                                    "recipe.generate.prompts=[add 12+30]",
                                    "recipe.generate.max_new_tokens=4")
    assert code == 0, err
    assert COMPILED_MARK in out
    assert dtypes and all(dtype == torch.bfloat16 for dtype in dtypes), dtypes
