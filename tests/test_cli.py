"""The ``tpu-train`` command line: help, printing the config, multirun and one-line errors."""

from __future__ import annotations

import pytest

from tests.trainer.cli_helpers import TINY, one_thread, run_in_process, snapshot  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    """A run directory holding a real checkpoint from a 1-step run."""
    run_dir = tmp_path_factory.mktemp("existing") / "run"
    code, _, err = run_in_process(*TINY, "trainer.max_steps=1", f"run.dir={run_dir}")
    assert code == 0, err
    return run_dir


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "empty.jsonl").write_text("")
    (root / "broken.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    (root / "nofield.jsonl").write_text('{"title": "no text here"}\n')
    (root / "notdict.jsonl").write_text('[1, 2, 3]\n')
    return root


_COMPILED = ["trainer.mode=compiled", "trainer.device=tpu"]
BAD_CONFIGS = {
    "unknown_key": (["trainer.maxsteps=3"], "section 'trainer' has keys"),
    "unknown_top_level": (["trainr.seed=1"], "the top level has keys"),
    "unknown_nested_key": (["recipe.lora.rnk=4"], "alpha, dropout, rank, targets"),
    "unknown_recipe": (["recipe=llama_pretrian"], "valid options: eval, generate"),
    "unknown_model": (["model=llama9"], "valid options: debug_tiny"),
    "unknown_scheduler": (["scheduler=linear"], "valid options: constant"),
    "wrong_type": (["trainer.max_steps=ten"], "could not be converted to Integer"),
    "bad_enum": (["trainer.mode=fast"], "expected one of [eager, compiled]"),
    "bad_precision": (["trainer.precision=fp8"], "expected one of [fp32, bf16]"),
    "zero_steps": (["trainer.max_steps=0"], "trainer.max_steps must be >= 1"),
    "negative_lr": (["optim.lr=-1"], "optim.lr must be > 0"),
    "bad_beta": (["optim.beta2=1.5"], "optim.beta1 and optim.beta2"),
    "negative_warmup": (["scheduler.warmup_steps=-1"], "scheduler.warmup_steps must be >= 0"),
    "added_unknown_key": (["+trainer.foo=1"], "trainer.foo is not a setting"),
    "added_unknown_section": (["+bogus_section.x=2"], "bogus_section is not a setting"),
    "bad_profile_steps": (["logging.profile_steps=[3,2]"], "logging.profile_steps must be"),
    "keep_last_zero": (["checkpoint.keep_last=0"], "checkpoint.keep_last must be >= 1"),
    "every_n_zero": (["checkpoint.every_n_steps=0"], "checkpoint.every_n_steps must be >= 1"),
    "bad_parallel": (["parallel.fsdp=0"], "parallel.fsdp must be -1 (infer) or >= 1"),
    "two_inferred_axes": (["parallel.fsdp=-1", "parallel.tensor=-1"],
                          "at most one of parallel.fsdp and parallel.tensor"),
    "eager_parallel_needs_processes": (["parallel.fsdp=2"], "launch torchrun --nproc-per-node 2"),
    "bad_device": (["trainer.device=gpu"], "valid devices: cpu, tpu"),
    "cpu_threads_zero": (["trainer.cpu_threads=0"], "trainer.cpu_threads must be >= 1 or null"),
    "compiled_on_cpu": (["trainer.mode=compiled"], "trainer.mode=compiled needs trainer.device=tpu"),
    "seq_len_too_long": (["data.seq_len=100000"], "exceeds the model's max_seq_len"),
    "missing_data_file": (["data.path=/nonexistent/train.jsonl"], "does not exist"),
    "missing_model_checkpoint": (["model.checkpoint=/nonexistent/ckpt"], "is not a directory"),
    "pretrain_with_checkpoint": (["recipe=llama_pretrain", "model.checkpoint=."], "starts from random weights"),
    "bad_lora_target": (["recipe=llama_lora", "recipe.lora.targets=[wq,q_proj]"], "match no nn.Linear"),
    "bad_lora_rank": (["recipe=llama_lora", "recipe.lora.rank=0"], "recipe.lora.rank must be >= 1"),
    "jsonl_without_path": (["data=jsonl"], "data.path"),
    "bad_format": (["data.format=csv"], "valid formats: auto, text, instruction, chat"),
    "bad_override_syntax": (["trainer.max_steps=["], "trainer.max_steps"),
    "resume_with_other_seq_len": (["data.seq_len=16"], "holds a checkpoint of a different configuration"),
    # The compiled step on the session's 8 virtual devices: every mesh mismatch is bad input.
    "mesh_larger_than_devices": ([*_COMPILED, "parallel.data=1", "parallel.fsdp=16"],
                                 "= 16, but there are 8 devices"),
    "mesh_not_dividing_devices": ([*_COMPILED, "parallel.tensor=3"],
                                  "multiply to 3, which does not divide the 8 devices"),
    "tensor_not_dividing_kv_heads": ([*_COMPILED, "parallel.data=1", "parallel.fsdp=2",
                                      "parallel.tensor=4"], "does not divide n_kv_heads=2"),
    "batch_not_splitting_over_mesh": ([*_COMPILED, "data.batch_size=4"],
                                      "data.batch_size=4 (the global batch) does not split over "
                                      "parallel.data * fsdp = 8 * 1 = 8 ways"),
    "temperature": (["recipe=generate", "recipe.generate.temperature=-1"], "temperature must be >= 0"),
}

BAD_DATA = {
    "empty_file": ("empty.jsonl", "empty"),
    "broken_json": ("broken.jsonl", "broken.jsonl:2"),
    "missing_field": ("nofield.jsonl", "nofield.jsonl:1"),
    "not_an_object": ("notdict.jsonl", "notdict.jsonl:1"),
}


def _assert_one_line_error(code, out, err, expected):
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tpu-train: error: "), lines[0]
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_is_one_line_and_writes_nothing(name, existing_run):
    overrides, expected = BAD_CONFIGS[name]
    before = snapshot(existing_run)
    code, out, err = run_in_process(*TINY, "trainer.max_steps=2", f"run.dir={existing_run}",
                                    *overrides)
    _assert_one_line_error(code, out, err, expected)
    assert snapshot(existing_run) == before


@pytest.mark.parametrize("name", sorted(BAD_DATA))
def test_bad_data_is_one_line_and_writes_nothing(name, existing_run, bad_data):
    filename, expected = BAD_DATA[name]
    before = snapshot(existing_run)
    code, out, err = run_in_process(*TINY, "trainer.max_steps=2", f"run.dir={existing_run}",
                                    "data=jsonl", f"data.path={bad_data / filename}")
    _assert_one_line_error(code, out, err, expected)
    assert snapshot(existing_run) == before


def test_help_lists_recipes():
    code, out, err = run_in_process("--help")
    assert code == 0, err
    for recipe in ("llama_pretrain", "llama_finetune", "llama_lora", "generate", "eval"):
        assert recipe in out
    assert "recipe: eval, generate, llama_finetune, llama_lora, llama_pretrain" in out
    assert "model: debug_tiny, debug_tiny_base, llama2_7b" in out


def test_cfg_job_prints_composed_config():
    code, out, err = run_in_process("recipe=llama_lora", "trainer.seed=7", "--cfg", "job")
    assert code == 0, err
    assert "name: llama_lora" in out and "seed: 7" in out and "rank: 8" in out


def test_multirun_gives_each_job_its_own_run_dir(tmp_path):
    base = tmp_path / "sweep"
    code, out, err = run_in_process("-m", *TINY, "trainer.max_steps=1", f"run.dir={base}",
                                    "trainer.seed=1,2")
    assert code == 0, err
    for job in ("0", "1"):
        assert (base / job / "checkpoints" / "step_00000001" / "meta.json").is_file()
    seeds = [(base / job / "run_config.yaml").read_text() for job in ("0", "1")]
    assert "seed: 1" in seeds[0] and "seed: 2" in seeds[1]


@pytest.mark.parametrize("where", ["empty", "a_file", "under_a_file"])
def test_unusable_run_dir_is_one_line_and_writes_nothing(where, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    run_dir = {"empty": "", "a_file": str(blocker), "under_a_file": str(blocker / "run")}[where]
    expected = {"empty": "run.dir is empty", "a_file": "is a file, not a directory",
                "under_a_file": "which is a file"}[where]
    before = snapshot(tmp_path)
    code, out, err = run_in_process(*TINY, "trainer.max_steps=1", f"run.dir={run_dir}")
    _assert_one_line_error(code, out, err, expected)
    assert snapshot(tmp_path) == before


def test_bad_platform_is_one_line(tmp_path):
    """TPU_TRAIN_PLATFORM is read when tpu_train is imported: a child process each."""
    import os
    import subprocess
    import sys

    cases = {"bogus": "is not a known platform", "tpu": "but JAX finds no tpu devices"}
    for value, expected in cases.items():
        env = dict(os.environ, TPU_TRAIN_PLATFORM=value)
        done = subprocess.run([sys.executable, "-m", "tpu_train.cli", *TINY, "trainer.device=tpu",
                               "trainer.max_steps=1", f"run.dir={tmp_path / value}"],
                              env=env, capture_output=True, text=True, timeout=120)
        _assert_one_line_error(done.returncode, done.stdout, done.stderr, expected)
        assert not (tmp_path / value).exists()
