"""A run that tells the user what it is doing, and the config switches around resuming."""

from __future__ import annotations


import pytest

from tests.trainer.cli_helpers import (TINY, one_thread, read_metrics, run_in_process,  # noqa: F401
                                      snapshot, start_subprocess)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.host_cpu_run
def test_start_summary_tensorboard_hparams_and_profile(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*TINY, "trainer.max_steps=3", "scheduler.warmup_steps=10",
                                    "logging.profile_steps=[2,3]", "logging.progress_bar=true",
                                    f"run.dir={run_dir}")
    assert code == 0, err
    # Output that is not a terminal gets no progress bar (its redraws would garble a log file).
    assert "it/s" not in err and "step/s" not in err and "\r" not in err, err
    # A warmup longer than the run is shortened, and the run says so.
    assert "note: scheduler.warmup_steps=10 is longer than the 3-step run" in out
    for field in ("model: Llama dim 256, 4 layers, 4/2 heads, vocab 512, 3.4 M parameters "
                  "(3.4 M trainable)",
                  "global batch 2 x 32 tokens x 1 accumulation = 64 tokens/step",
                  "budget 3 steps = 192 tokens", "device: cpu | mesh data=1 fsdp=1 tensor=1",
                  "precision: fp32", "memory: ", "profiled steps 2-3"):
        assert field in out, (field, out)
    # The resolved config goes to the log file, not the console.
    log = (run_dir / "train.log").read_text()
    assert "max_steps: 3" in log and "max_steps: 3" not in out
    events = EventAccumulator(str(run_dir / "tensorboard"),
                              size_guidance={"tensors": 0}).Reload()
    assert "config/text_summary" in events.Tags()["tensors"]
    plugins = events.PluginTagToContent("hparams")
    assert "_hparams_/experiment" in plugins and "_hparams_/session_start_info" in plugins
    traces = list((run_dir / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert traces, sorted(p.name for p in (run_dir / "tensorboard").rglob("*"))


@pytest.mark.host_cpu_run
def test_load_step_supersedes_later_checkpoints_and_resumes_exactly(tmp_path):
    run_dir = tmp_path / "run"
    common = [*TINY, "trainer.max_steps=4", "checkpoint.every_n_steps=2", f"run.dir={run_dir}"]
    code, _, err = run_in_process(*common)
    assert code == 0, err
    first = {step: record["train/loss"] for step, record in read_metrics(run_dir).items()}

    before = snapshot(run_dir)
    code, _, err = run_in_process(*common, "checkpoint.load_step=3")
    assert code == 2 and "has steps [2, 4]" in err, err
    code, _, err = run_in_process(*common, "checkpoint.resume=false")
    assert code == 2 and "checkpoint.resume=false" in err and len(err.splitlines()) == 1, err
    assert snapshot(run_dir) == before

    code, out, err = run_in_process(*common, "checkpoint.load_step=2")
    assert code == 0, err
    assert "(resumed from step_00000002)" in out
    assert [p.name.split("-")[0] for p in (run_dir / "checkpoints" / "superseded").iterdir()] \
        == ["step_00000004"]
    again = {step: record["train/loss"] for step, record in read_metrics(run_dir).items()}
    assert again == first  # steps 3 and 4 replayed bit for bit


@pytest.mark.host_cpu_run
def test_saved_run_config_reruns_the_run(tmp_path):
    run_dir = tmp_path / "run"
    code, _, err = run_in_process(*TINY, "trainer.max_steps=2", "trainer.seed=5",
                                  f"run.dir={run_dir}")
    assert code == 0, err
    saved = (run_dir / "run_config.yaml").read_text()
    assert saved.startswith("# tpu-train --config-dir") and "seed: 5" in saved
    assert not (run_dir / "config.yaml").exists()
    code, out, err = run_in_process("--config-dir", str(run_dir), "--config-name", "run_config")
    assert code == 0, err
    # The same run: it resumes the finished checkpoint instead of starting a new one.
    assert "(resumed from step_00000002)" in out and "finished step 2/2" in out


@pytest.mark.host_cpu_run
def test_a_copied_recipe_runs_with_its_own_changes(tmp_path, monkeypatch):
    from tpu_train import cli

    shipped = cli.recipe_names()
    assert shipped == ["eval", "generate", "llama_finetune", "llama_lora", "llama_pretrain",
                       "plan"]
    from importlib import resources

    source = resources.files(cli.RECIPES_PACKAGE) / "llama_finetune.py"
    mine = tmp_path / "my_recipe.py"
    mine.write_text(source.read_text().replace(
        "    job = trainer.start(cfg)", "    print('my recipe runs')\n    job = trainer.start(cfg)"))
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    code, out, err = run_in_process("recipe=./my_recipe.py", *TINY, "trainer.max_steps=1",
                                    f"run.dir={run_dir}")
    assert code == 0, err
    assert "my recipe runs" in out and "finished step 1/1" in out
    assert f"script: {mine}" in (run_dir / "run_config.yaml").read_text()

    code, _, err = run_in_process("recipe=./missing.py", *TINY)
    assert code == 2 and "recipe=./missing.py: no such recipe script" in err, err


@pytest.mark.host_cpu_run
def test_resuming_with_another_lr_says_the_checkpoint_settings_are_kept(tmp_path):
    run_dir = tmp_path / "run"
    code, _, err = run_in_process(*TINY, "trainer.max_steps=2", f"run.dir={run_dir}")
    assert code == 0, err
    code, out, err = run_in_process(*TINY, "trainer.max_steps=3", "optim.lr=1e10",
                                    "scheduler.extend=true", f"run.dir={run_dir}")
    assert code == 0, err
    assert "note: optim.lr=1e+10 differs from the resumed checkpoint's 0.0005" in out
    metrics = read_metrics(run_dir)
    assert metrics[3]["train/lr"] < 1e-3  # the checkpoint's schedule went on


@pytest.mark.host_cpu_run
def test_own_data_runs_on_the_default_model_with_the_seq_len_it_allows(tmp_path):
    """README's own-data command (data=jsonl, nothing else about the data) on the default
    model: data.seq_len: null becomes the model's maximum positions, and the run says so."""
    import json

    from tpu_train.trainer.config import asset_path

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"add {i}+{i}\n", "response": str(2 * i)}) + "\n"
                            for i in range(40)))
    run_dir = tmp_path / "run"
    tiny = [o for o in TINY if not o.startswith("data.seq_len=")]
    code, out, err = run_in_process(*tiny, "data=jsonl", f"data.path={data}",
                                    "trainer.max_steps=1", f"run.dir={run_dir}")
    assert code == 0, err
    with open(f"{asset_path('base_model')}/config.json") as handle:  # the default model
        model_max = json.load(handle)["max_position_embeddings"]
    assert f"note: data.seq_len=null: {model_max} tokens (the model's maximum positions" in out
    assert f"global batch 2 x {model_max} tokens" in out
    assert f"seq_len: {model_max}" in (run_dir / "run_config.yaml").read_text()


def test_null_seq_len_is_capped_for_models_with_long_positions():
    from omegaconf import OmegaConf

    from tpu_train.models import get_config
    from tpu_train.planning.command import DEFAULT_MAX_SEQ_LEN as PLANNED_CAP
    from tpu_train.trainer.config import DEFAULT_MAX_SEQ_LEN
    from tpu_train.trainer.validation import resolve_seq_len

    assert get_config("llama3_1_8b").max_seq_len > DEFAULT_MAX_SEQ_LEN == PLANNED_CAP
    cfg = OmegaConf.create({"model": {"name": "llama3_1_8b", "checkpoint": None},
                            "data": {"seq_len": None}})
    note = resolve_seq_len(cfg)
    assert cfg.data.seq_len == DEFAULT_MAX_SEQ_LEN
    assert note.startswith(f"note: data.seq_len=null: {DEFAULT_MAX_SEQ_LEN} tokens (the model "
                           f"allows {get_config('llama3_1_8b').max_seq_len}")
    assert resolve_seq_len(cfg) is None  # set: left alone


def _stop_after_first_step(tmp_path, *overrides: str) -> tuple[str, str]:
    """``tpu-train overrides...`` in a child process working in ``tmp_path`` (so the default
    run.dir lands there), stopped by SIGINT (Ctrl-C) once a step is logged; (stdout, stderr)."""
    import signal
    import time

    process = start_subprocess(*overrides, cwd=tmp_path)
    deadline = time.monotonic() + 240
    while not any(read_metrics(d) for d in tmp_path.glob("runs/*/*")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return out, err


@pytest.mark.host_cpu_run
def test_ctrl_c_prints_the_command_that_resumes_and_run_dir_latest_finds_it(tmp_path,
                                                                           monkeypatch):
    import shlex

    steps = ["trainer.max_steps=40", "checkpoint.every_n_steps=1000"]
    out, _ = _stop_after_first_step(tmp_path, *TINY, *steps)
    (run_dir,) = list((tmp_path / "runs" / "llama_finetune").iterdir())  # the default run.dir
    (stop_line,) = [line for line in out.splitlines() if line.startswith("stopped by SIGINT")]
    command = stop_line.split("Resume with: ", 1)[1]
    args = shlex.split(command)
    assert args[0] == "tpu-train" and args[1:-1] == [*TINY, *steps], args
    assert args[-1] == f"run.dir=runs/llama_finetune/{run_dir.name}"
    stopped_at = max(read_metrics(run_dir))
    assert stopped_at < 40

    monkeypatch.chdir(tmp_path)
    # run.dir=latest: the newest unfinished run of the recipe.
    code, out, err = run_in_process(*TINY, *steps, "run.dir=latest")
    assert code == 0, err
    assert (f"note: run.dir=latest: resuming runs/llama_finetune/{run_dir.name} from step "
            f"{stopped_at} of 40") in out
    assert f"(resumed from step_{stopped_at:08d})" in out and "finished step 40/40" in out
    assert [p.name for p in (tmp_path / "runs" / "llama_finetune").iterdir()] == [run_dir.name]
    # The printed command resumes the same run (finished now: nothing left to train).
    code, out, err = run_in_process(*args[1:])
    assert code == 0, err
    assert "(resumed from step_00000040)" in out and f"run dir: runs/llama_finetune/{run_dir.name}" in out
    # No unfinished run is left: one line, nothing written.
    before = snapshot(tmp_path)
    code, out, err = run_in_process(*TINY, *steps, "run.dir=latest")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "run.dir=latest: no unfinished run of recipe llama_finetune under runs/llama_finetune/" in err
    assert snapshot(tmp_path) == before


@pytest.mark.host_cpu_run
def test_a_larger_max_steps_on_resume_is_refused_or_extends_the_schedule(tmp_path):
    """WSD over 4 steps (warmup 1, decay over the last round(0.2 * 4) = 1 step) ends at lr 0:
    resuming with trainer.max_steps=6 would train two steps at lr 0. Refused in one line
    naming that rate; with scheduler.extend=true the 6-step schedule goes on (decay over its
    last round(0.2 * 6) = 1 step): step 5 at the full lr, step 6 at 0."""
    run_dir = tmp_path / "run"
    common = [*TINY, "scheduler=wsd", "scheduler.warmup_steps=1", "optim.lr=5e-4",
              f"run.dir={run_dir}"]
    code, _, err = run_in_process(*common, "trainer.max_steps=4")
    assert code == 0, err
    assert read_metrics(run_dir)[4]["train/lr"] == 0.0
    before = snapshot(run_dir)
    code, out, err = run_in_process(*common, "trainer.max_steps=6")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert ("trainer.max_steps=6 goes past the resumed schedule, which ends at step 4: steps "
            "5-6 would train at lr 0; set scheduler.extend=true") in err
    assert snapshot(run_dir) == before

    code, out, err = run_in_process(*common, "trainer.max_steps=6", "scheduler.extend=true")
    assert code == 0, err
    assert "note: scheduler.extend=true: the schedule now ends at step 6 instead of 4; lr 0 -> " \
           "0.0005 at step 5" in out
    metrics = read_metrics(run_dir)
    assert metrics[5]["train/lr"] == pytest.approx(5e-4, rel=1e-6)
    assert metrics[6]["train/lr"] == 0.0


@pytest.mark.host_cpu_run
def test_progress_lines_carry_an_eta_once_there_is_a_rate(tmp_path):
    import re

    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*TINY, "trainer.max_steps=4", f"run.dir={run_dir}")
    assert code == 0, err
    lines = {int(m.group(1)): line for line in out.splitlines()
             if (m := re.match(r"step (\d)/4 \| loss", line))}
    assert sorted(lines) == [1, 2, 3, 4]
    # Step 1 (it compiles, in other modes) gives no rate; the last step has nothing left.
    assert "eta" not in lines[1] and "eta" not in lines[4]
    for step in (2, 3):
        assert re.search(r" \| eta \d+:\d\d$", lines[step]), lines[step]


def test_third_party_noise_is_off_unless_verbose(tmp_path):
    """In a fresh process: the libraries' warnings and log records are dropped by default and
    come through with verbose=True; the run's own loggers are untouched either way."""
    import os
    import subprocess
    import sys

    script = ("import logging, sys, warnings\n"
              "from tpu_train.trainer.log_noise import quiet_third_party_logs\n"
              "logging.basicConfig()\n"
              "quiet_third_party_logs(sys.argv[1] == 'verbose')\n"
              "warnings.warn_explicit('hf noise', UserWarning, 'x.py', 1, module='transformers.x')\n"
              "logging.getLogger('jax._src.xla_bridge').warning('jax noise')\n"
              "logging.getLogger('absl').warning('absl noise')\n"
              "logging.getLogger('jax').error('jax error')\n"
              "logging.getLogger('mine').warning('mine shows')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL",
                                                             "TRANSFORMERS_VERBOSITY")}
    noise = ("hf noise", "jax noise", "absl noise")
    for mode in ("quiet", "verbose"):
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True,
                              text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "mine shows" in done.stderr and "jax error" in done.stderr, done.stderr
        shown = [text for text in noise if text in done.stderr]
        assert shown == ([] if mode == "quiet" else list(noise)), done.stderr


def test_the_command_line_keeps_xla_warnings_off_before_jax_starts(monkeypatch):
    import os

    import tpu_train

    for argv, quiet in [(["python", "-m", "tpu_train.cli", "trainer.max_steps=2"], True),
                        (["python", "-m", "tpu_train.cli", "logging.verbose=true"], False),
                        (["/venv/bin/python", "/venv/bin/tpu-train", "logging.verbose=True"], False),
                        (["/venv/bin/python", "/venv/bin/tpu-train", "recipe=llama_lora"], True),
                        (["python", "train.py"], False)]:  # a user's script importing tpu_train
        monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
        monkeypatch.setattr("sys.orig_argv", argv)
        monkeypatch.setattr("sys.argv", ["-m", *argv[3:]] if "-m" in argv else argv[1:])
        tpu_train._quiet_xla_for_the_command_line()
        assert (os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "2") == quiet, argv


@pytest.mark.host_cpu_run
def test_the_summary_compares_the_starting_model_with_the_final_one(tmp_path):
    """trainer.val_at_start validates the model before step 1; a resumed run's summary still
    compares with those step-0 figures (from metrics.jsonl); val_at_start=false skips it."""
    import json
    import re

    run_dir = tmp_path / "run"
    validation = ["trainer.val_every_n_steps=2", "trainer.val_batches=1",
                  "recipe.eval.exact_match_examples=2", "recipe.eval.max_new_tokens=4"]
    common = [*TINY, *validation, f"run.dir={run_dir}"]
    code, out, err = run_in_process(*common, "trainer.max_steps=2")
    assert code == 0, err
    assert "\nstep 0/2 | validation | " in out
    code, out, err = run_in_process(*common, "trainer.max_steps=4", "scheduler.extend=true")
    assert code == 0, err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = {row["step"]: row for row in rows if "val/loss" in row}
    assert sorted(val) == [0, 2, 4]  # step 0 once: the resumed run did not validate it again
    summary = out[out.index("finished step 4/4"):]
    assert (f"validation at step 4: exact match {val[0]['val/exact_match']:.1%} -> "
            f"{val[4]['val/exact_match']:.1%} on 2 held-out examples, loss "
            f"{val[0]['val/loss']:.4f} -> {val[4]['val/loss']:.4f}") in summary, summary
    assert re.search(r"wall time: +[0-9.]+ s", summary), summary

    other = tmp_path / "other"
    code, out, err = run_in_process(*TINY, *validation, "trainer.max_steps=2",
                                    "trainer.val_at_start=false", f"run.dir={other}")
    assert code == 0, err
    assert "step 0/2 | validation" not in out and "\nstep 2/2 | validation | " in out
    assert " -> " not in out[out.index("finished step 2/2"):]


def test_stdout_line_filter_drops_only_gloo_connection_lines():
    """Writes to file descriptor 1 (as Gloo's C++ code does, whole or two ranks' lines woven
    into each other) and through Python, in a fresh process: the connection lines go,
    everything else arrives in order, the unterminated last line included."""
    import subprocess
    import sys

    script = ("import os, sys\n"
              "from tpu_train.trainer.log_noise import quiet_process_group_noise\n"
              "assert quiet_process_group_noise(2, verbose=True) is None\n"
              "quiet_process_group_noise(2, verbose=False)\n"
              "print('first', flush=True)\n"
              "os.write(1, b'[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of '\n"
              "            b'connected peer ranks is : 7\\n')\n"
              "os.write(1, b'[Gloo] Rank 3[Gloo] Rank 2 is connected to 7 peer ranks. Expected '\n"
              "            b'number of connected peer ranks is : 7\\n is connected to 7 peer '\n"
              "            b'ranks. Expected number of connected peer ranks is : 7\\n')\n"
              "print('[Gloo] something else')\n"
              "sys.stdout.write('last, unterminated')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"first\n[Gloo] something else\nlast, unterminated", done.stdout


@pytest.mark.host_cpu_run
def test_max_minutes_stops_with_a_checkpoint_and_the_command_that_resumes(tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*TINY, "trainer.max_steps=1000", "trainer.max_minutes=0.0001",
                                    "checkpoint.every_n_steps=1000", f"run.dir={run_dir}")
    assert code == 0, err
    (stop_line,) = [line for line in out.splitlines() if line.startswith("stopped by ")]
    step = max(read_metrics(run_dir))
    assert stop_line.startswith(f"stopped by trainer.max_minutes=0.0001 at step {step}; "
                                "checkpoint saved. Resume with: tpu-train "), stop_line
    assert stop_line.endswith(f"run.dir={run_dir}") and step < 1000
    assert f"stopped at step {step}/1000" in out
    code, _, err = run_in_process(*TINY, "trainer.max_minutes=0", f"run.dir={tmp_path / 'x'}")
    assert code == 2 and "trainer.max_minutes must be > 0 or null" in err, err


@pytest.mark.parametrize("override, remat", [
    ("trainer.activation_checkpointing=true", "full"),
    ("trainer.activation_checkpointing=false", None),
    ("trainer.remat=save_dots", "save_dots"),
    ("trainer.remat=save_qkv_proj", "save_qkv_proj"),
    ("trainer.remat=none", None)])
def test_assemble_applies_remat_with_the_layout(override, remat, tmp_path):
    """trainer.remat (and activation_checkpointing=true, which is remat=full) is applied by
    ``trainer.assemble`` (where the layout is applied), so a recipe, copied or not, cannot
    silently leave it out."""
    from hydra import compose, initialize_config_dir

    from tpu_train import cli, trainer
    from tpu_train.compile.remat_regions import forward_remat
    from tpu_train.trainer.config import register_schema

    register_schema()
    overrides = [*TINY, override, f"run.dir={tmp_path / 'run'}"]
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    run = trainer.assemble(trainer.start(cfg))
    applied = [forward_remat(vars(layer).get("forward")) for layer in run.model.layers]
    assert applied == [remat] * len(run.model.layers)
    assert not (tmp_path / "run").exists()  # assembling writes nothing
