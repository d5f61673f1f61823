"""``run.dir`` at an fsspec URL: a run saves, resumes and exports there, and nothing of it lands
on the local disk (no ``./memory:/...`` or ``./gs:/...`` directory).

``memory://`` lives inside one process, so those runs go through the CLI in-process
(``run_in_process``); ``gs://`` runs in child processes against a local GCS emulator, where
gcsfs and the emulator are installed (the tpu extra and the test extra), in the slow set
(``pytest -m slow tests/trainer/test_run_dir_urls.py``).
"""

from __future__ import annotations

import json
import shlex
import sys

import fsspec
import pytest

from tests.trainer.cli_helpers import TINY, one_thread, run_in_process  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

MEMORY = fsspec.filesystem("memory")


def _losses(text: str) -> dict[int, float]:
    rows = [json.loads(line) for line in text.splitlines()]
    return {row["step"]: row["train/loss"] for row in rows if "train/loss" in row}


def _resume_command(out: str) -> list[str]:
    """The overrides of the ``Resume with: tpu-train ...`` line of a stopped run."""
    (line,) = [line for line in out.splitlines() if "Resume with: " in line]
    args = shlex.split(line.split("Resume with: ", 1)[1])
    assert args[0] == "tpu-train", line
    return args[1:]


@pytest.mark.host_cpu_run
def test_a_memory_url_run_saves_resumes_and_exports(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"memory://runs/{tmp_path.name}"
    root = f"/runs/{tmp_path.name}"
    common = [*TINY, "trainer.max_steps=4", "checkpoint.every_n_steps=2",
              "checkpoint.export_hf=true", f"run.dir={url}"]
    code, out, err = run_in_process(*common)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()]
    assert ["run", "dir:", url] in rows and ["hf", "export:", f"{url}/hf"] in rows, out
    files = {p.removeprefix(root + "/") for p in MEMORY.find(root)}
    for name in ("run_config.yaml", "train.log", "metrics.jsonl", "hf/config.json",
                 "hf/model.safetensors", "hf/tokenizer.json",
                 *(f"checkpoints/step_0000000{s}/{f}" for s in (2, 4)
                   for f in ("meta.json", "model.safetensors", "training_state.pt"))):
        assert name in files, (name, sorted(files))
    assert any(name.startswith("tensorboard/events.out.tfevents") for name in files), files
    assert "finished step 4/4" in MEMORY.cat(f"{root}/train.log").decode()
    first = _losses(MEMORY.cat(f"{root}/metrics.jsonl").decode())
    assert sorted(first) == [1, 2, 3, 4]

    # Back to step 2: step 4 is moved aside and steps 3 and 4 replay bit for bit.
    code, out, err = run_in_process(*common, "checkpoint.load_step=2")
    assert code == 0, err
    assert "(resumed from step_00000002)" in out
    superseded = MEMORY.ls(f"{root}/checkpoints/superseded", detail=False)
    assert [p.rsplit("/", 1)[1].split("-")[0] for p in superseded] == ["step_00000004"]
    assert _losses(MEMORY.cat(f"{root}/metrics.jsonl").decode()) == first
    log = MEMORY.cat(f"{root}/train.log").decode()
    assert log.count("finished step 4/4") == 2  # the resumed run appended to the first's log
    assert list(tmp_path.iterdir()) == []  # nothing local: no ./memory:/ directory
    MEMORY.rm(root, recursive=True)


@pytest.mark.host_cpu_run
def test_a_stopped_memory_url_run_resumes_by_latest_and_by_its_printed_command(tmp_path,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = f"memory://sweeps/{tmp_path.name}"
    steps = [*TINY, "trainer.max_steps=3", "checkpoint.every_n_steps=100"]
    # A budget of a few milliseconds: the run stops after its first step, saving a checkpoint.
    code, out, err = run_in_process(*steps, "trainer.max_minutes=0.0001", f"run.dir={root}/a")
    assert code == 0, err
    resume = _resume_command(out)
    assert resume[-1] == f"run.dir={root}/a", resume

    code, out, err = run_in_process(*steps, f"run.dir={root}/latest")
    assert code == 0, err
    assert f"note: run.dir={root}/latest: resuming {root}/a from step 1 of 3" in out
    assert "(resumed from step_00000001)" in out and "finished step 3/3" in out
    code, out, err = run_in_process(*resume)
    assert code == 0, err
    assert "(resumed from step_00000003)" in out
    code, out, err = run_in_process(*steps, f"run.dir={root}/latest")
    assert code == 2 and f"no unfinished run under {root}/" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []
    MEMORY.rm(f"/sweeps/{tmp_path.name}", recursive=True)


@pytest.mark.host_cpu_run
def test_a_file_url_is_the_local_directory(tmp_path, monkeypatch):
    """``file:///...`` is written like the local path (a temporary directory renamed into
    place); the printed resume command names that directory."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    run_dir = tmp_path / "x"
    steps = [*TINY, "trainer.max_steps=2", "checkpoint.every_n_steps=100",
             "checkpoint.export_hf=true"]
    code, out, err = run_in_process(*steps, "trainer.max_minutes=0.0001",
                                    f"run.dir=file://{run_dir}")
    assert code == 0, err
    assert (run_dir / "checkpoints" / "step_00000001" / "meta.json").is_file()
    resume = _resume_command(out)
    assert resume[-1] == f"run.dir={run_dir}", resume
    code, out, err = run_in_process(*resume)
    assert code == 0, err
    assert "(resumed from step_00000001)" in out and "finished step 2/2" in out
    # The time limit (repeated by the command) also ends that run, at its last step: the
    # export comes with the next, which has nothing left to train.
    code, out, err = run_in_process(*resume)
    assert code == 0, err
    assert "(resumed from step_00000002)" in out
    assert any(line.split() == ["hf", "export:", f"{run_dir}/hf"] for line in out.splitlines())
    assert (run_dir / "hf" / "model.safetensors").is_file()
    assert list(work.iterdir()) == []  # no ./file:/ directory


def test_an_unknown_protocol_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_in_process(*TINY, "run.dir=nosuch://bucket/runs/x")
    assert code == 2, err
    assert err.strip() == ("tpu-train: error: run.dir='nosuch://bucket/runs/x': unknown storage "
                           "protocol nosuch://; use a local path or a URL of a filesystem fsspec "
                           "knows (gs://, s3://, memory://, ...)")
    assert list(tmp_path.iterdir()) == []


def test_gs_without_gcsfs_is_one_line_naming_the_package(tmp_path):
    """A fresh process where ``import gcsfs`` fails (as where it is not installed)."""
    import subprocess

    from tests.platforms import cpu_child_env
    from tests.trainer.cli_helpers import ROOT

    program = ("import sys; sys.modules['gcsfs'] = None; from tpu_train.cli import main; "
               "sys.argv = ['tpu-train', *sys.argv[1:]]; main()")
    result = subprocess.run([sys.executable, "-c", program, *TINY, "run.dir=gs://bucket/runs/x"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=cpu_child_env(ROOT))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "tpu-train: error: run.dir='gs://bucket/runs/x': gs:// needs the gcsfs package: "
        "pip install gcsfs (or pip install 'tpu_train[gcs]')")
    assert list(tmp_path.iterdir()) == []  # above all, no ./gs:/ directory


def test_an_interrupted_save_at_a_url_is_never_resumed_and_is_cleaned_up(tmp_path,
                                                                         monkeypatch):
    """An object store has no rename: a save that dies before its meta.json (written last)
    leaves a step_N that is neither listed nor resumed, and the next writer deletes it."""
    import torch

    from tpu_train.trainer import checkpoint
    from tpu_train.trainer.storage_urls import run_path

    run_dir = run_path(f"memory://interrupted/{tmp_path.name}")
    model = {"w": torch.arange(4.0)}
    first = checkpoint.write_checkpoint(run_dir / "checkpoints", 1, model, {"n": 1})
    assert checkpoint.verify_checkpoint(first) is None

    def dies(*args, **kwargs):
        raise OSError("connection reset")

    monkeypatch.setattr(checkpoint.torch, "save", dies)  # after model.safetensors is up
    with pytest.raises(OSError, match="connection reset"):
        checkpoint.write_checkpoint(run_dir / "checkpoints", 2, model, {"n": 2})
    monkeypatch.undo()
    half = run_dir / "checkpoints" / "step_00000002"
    assert (half / "model.safetensors").is_file() and not (half / "meta.json").exists()
    assert checkpoint.checkpoint_dirs(run_dir) == [(1, first)]
    assert checkpoint.latest_intact_checkpoint(run_dir) == (first, [])

    manager = checkpoint.CheckpointManager(run_dir, keep_last=3)
    manager.remove_stale_temporaries()
    assert not half.exists() and first.exists()
    manager.save(2, model, {"n": 2})  # the step written again, whole
    assert checkpoint.checkpoint_dirs(run_dir) == [(1, first), (2, half)]
    model_state, training_state, meta = checkpoint.read_checkpoint(half)
    assert torch.equal(model_state["w"], model["w"]) and training_state == {"n": 2}
    assert meta["step"] == 2 and checkpoint.verify_checkpoint(half) is None
    MEMORY.rm(run_dir.path, recursive=True)


def _gcs_emulator():
    """A local GCS server (gcp-storage-emulator) with bucket ``runs``, and the environment that
    points gcsfs at it; skipped where gcsfs or the emulator is not installed."""
    import socket

    pytest.importorskip("gcsfs")
    server_module = pytest.importorskip("gcp_storage_emulator.server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = server_module.create_server("127.0.0.1", port, in_memory=True,
                                         default_bucket="runs")
    server.start()
    # No hierarchical-namespace probe: gcsfs would ask a gRPC endpoint the emulator lacks.
    return server, {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
                    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


@pytest.mark.slow  # three child processes through the emulator: 1-2 minutes on 2 cores
@pytest.mark.host_cpu_run
@pytest.mark.timeout(600)
def test_a_gs_run_through_gcsfs_stops_resumes_with_its_command_and_exports(tmp_path):
    """The real gcsfs client against a local GCS emulator, each run a fresh process: a missing
    bucket is one line; Ctrl-C after the first step, then the printed command finishes the run
    and exports."""
    import signal
    import subprocess

    from tests.platforms import cpu_child_env
    from tests.trainer.cli_helpers import ROOT

    server, variables = _gcs_emulator()
    try:
        # Anonymous: no credentials are looked for (nor a cloud metadata server asked).
        env = cpu_child_env(ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                            FSSPEC_GS_TOKEN="anon", NO_GCE_CHECK="true", **variables)
        # A bucket that is not there: one line before the run starts.
        missing = subprocess.run([sys.executable, "-m", "tpu_train.cli", *TINY,
                                  "run.dir=gs://nosuchbucket/x"], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=300)
        assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
        assert missing.stderr.startswith("tpu-train: error: run.dir='gs://nosuchbucket/x': "
                                         "cannot write there (FileNotFoundError: "), missing.stderr

        steps = [*TINY, "trainer.max_steps=8", "checkpoint.every_n_steps=1000",
                 "checkpoint.export_hf=true"]
        first = subprocess.Popen([sys.executable, "-m", "tpu_train.cli", *steps,
                                  "run.dir=gs://runs/llama/x"], cwd=tmp_path, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lines = []
        for line in first.stdout:  # until the first step is logged
            lines.append(line)
            if line.startswith("step 1/8"):
                break
        first.send_signal(signal.SIGINT)
        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, err[-3000:]
        resume = _resume_command("".join(lines) + out)
        assert resume[-1] == "run.dir=gs://runs/llama/x" and resume[:-1] == steps, resume

        result = subprocess.run([sys.executable, "-m", "tpu_train.cli", *resume], cwd=tmp_path,
                                capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "(resumed from step_" in result.stdout and "finished step 8/8" in result.stdout

        import gcsfs

        store = gcsfs.GCSFileSystem(token="anon",
                                    endpoint_url=variables["STORAGE_EMULATOR_HOST"])
        files = {p.removeprefix("runs/llama/x/") for p in store.find("runs/llama/x")}
        for name in ("run_config.yaml", "train.log", "metrics.jsonl", "hf/config.json",
                     "hf/model.safetensors", "checkpoints/step_00000008/meta.json"):
            assert name in files, (name, sorted(files))
        rows = [json.loads(line) for line in store.cat("runs/llama/x/metrics.jsonl").splitlines()]
        assert [row["step"] for row in rows if "train/loss" in row] == list(range(1, 9))
        assert list(tmp_path.iterdir()) == []  # no ./gs:/ directory
    finally:
        server.stop()


@pytest.mark.host_cpu_run
def test_a_multirun_at_a_url_gives_each_job_its_own_directory_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = f"memory://multirun/{tmp_path.name}"
    code, out, err = run_in_process("-m", "trainer.seed=1,2", *TINY, "trainer.max_steps=1",
                                    f"run.dir={root}")
    assert code == 0, err
    for job in (0, 1):
        assert f"run dir: {root}/{job}" in out
        assert MEMORY.isfile(f"/multirun/{tmp_path.name}/{job}/checkpoints/step_00000001/meta.json")
    assert list(tmp_path.iterdir()) == []  # Hydra's own sweep directory is not ./memory:/...
    MEMORY.rm(f"/multirun/{tmp_path.name}", recursive=True)
