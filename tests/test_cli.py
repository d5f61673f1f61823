"""The ``tpu-train`` command line: help, printing the config, multirun and one-line errors
(the bad configurations and overrides are in tests/bad_input/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.cli_helpers import TINY, one_thread, run_in_process  # noqa: F401

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_help_lists_recipes():
    code, out, err = run_in_process("--help")
    assert code == 0, err
    for recipe in ("llama_pretrain", "llama_finetune", "llama_lora", "generate", "eval"):
        assert recipe in out
    assert "recipe: eval, generate, llama_finetune, llama_lora, llama_pretrain" in out
    presets = sorted(path.stem for path in (REPO / "configs" / "model").glob("*.yaml"))
    assert "debug_tiny" in presets and "llama3_1_8b" in presets
    assert "model: " + ", ".join(presets) + "\n" in out


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_quick_help_is_hydra_s_own(flag):
    # A bare --help is rendered without composing the config (cli._quick_help); with an
    # override Hydra composes it and renders the same template itself.
    quick, hydra_s = run_in_process(flag), run_in_process(flag, "trainer.seed=0")
    assert quick[0] == hydra_s[0] == 0, (quick[2], hydra_s[2])
    assert "Config groups (GROUP=OPTION):" in hydra_s[1]
    assert quick[1] == hydra_s[1]


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
