"""``tpu-train`` itself on a mesh: sharding plans, bf16, several processes, one model.

Every run here goes through the command line (in this process, or launched as a user would:
``python -m tpu_train.launch`` / ``torchrun``). The reference is the same command on ONE
device, run in a child process whose JAX sees a single CPU device (this session has 8).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.platforms import cpu_child_env
from tests.tolerances import loss_rtol
from tests.trainer.cli_helpers import read_metrics, run_in_process

STEPS = 6
# Sharded programs differ from one device's only in how their sums are split: fp32 rounding of
# STEPS steps of debug_tiny (longest reduction: the 768-wide feed-forward, 4 layers deep).
REL = loss_rtol(torch.float32, STEPS, reduction=768, depth=4)
# bf16 autocast against fp32: the acceptance figure for "the same training, in bf16" (a
# behaviour, not a rounding bound: bf16's own bound exceeds 100 % over 6 steps).
BF16_REL = 0.02
COMMON = [
    "recipe=llama_pretrain", "model=debug_tiny", "data.batch_size=8", "data.seq_len=32",
    "trainer.val_every_n_steps=0", "logging.progress_bar=false", "logging.every_n_steps=1",
    "checkpoint.export_hf=false", "scheduler.warmup_steps=1", f"trainer.max_steps={STEPS}",
    "trainer.mode=compiled", "trainer.device=tpu",
]
LAYOUTS = {
    "fsdp8": ["parallel.data=1", "parallel.fsdp=8", "parallel.tensor=1"],
    # debug_tiny's 4 layers as one lax.scan loop (the default scans 20 or more)
    "tp2_fsdp4_scanned": ["parallel.data=1", "parallel.fsdp=4", "parallel.tensor=2",
                          "trainer.scan_layers=true"],
    "dp2_fsdp2_tp2": ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"],
}


def _env(devices_per_process: int) -> dict:
    """Children on ``devices_per_process`` virtual devices of the CPU client (the cpu platform,
    also on a TPU host)."""
    return cpu_child_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                         XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")


def _losses(run_dir: Path, steps: int = STEPS) -> list[float]:
    metrics = read_metrics(run_dir)
    return [metrics[step]["train/loss"] for step in range(1, steps + 1)]


def _param_bytes(run_dir: Path) -> float:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "system/param_bytes_per_device" in record:
            return record["system/param_bytes_per_device"]
    raise AssertionError("no system/param_bytes_per_device in metrics.jsonl")


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """(losses, parameter + optimizer bytes) of the command on one device."""
    run_dir = tmp_path_factory.mktemp("one_device") / "run"
    done = subprocess.run([sys.executable, "-m", "tpu_train.cli", *COMMON, "parallel.data=-1",
                           f"run.dir={run_dir}"], env=_env(1), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mesh data=1 fsdp=1 tensor=1 (1 device, 1 process)" in done.stdout
    losses = _losses(run_dir)
    assert losses[-1] < losses[0]  # it trained: not six copies of one loss
    return losses, _param_bytes(run_dir)


@pytest.mark.devices(8)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mesh_from_the_command_line_matches_one_device(layout, one_device, tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = run_in_process(*COMMON, *LAYOUTS[layout], f"run.dir={run_dir}")
    assert code == 0, err
    degrees = dict(item.split("=") for item in LAYOUTS[layout])
    assert (f"mesh data={degrees['parallel.data']} fsdp={degrees['parallel.fsdp']} "
            f"tensor={degrees['parallel.tensor']} (8 devices, 1 process), SPMD plan llama_plan"
            in out), out
    # The compile event (a kept test cache, TPU_TRAIN_TEST_CACHE_DIR, may load the program)
    assert re.search(r"(compiled|loaded) the train step .*: first call", out), out
    assert ("first call; 4 layers scanned" in out) == layout.endswith("_scanned"), out
    losses = _losses(run_dir)
    assert losses == pytest.approx(one_device[0], rel=REL)
    if layout == "fsdp8":
        # Parameters and AdamW moments split 8 ways (norm scales too): 1/8 of one device's.
        assert _param_bytes(run_dir) <= 0.15 * one_device[1], (_param_bytes(run_dir), one_device)


@pytest.mark.devices(8)
def test_bf16_is_what_the_compiled_program_computes_in(one_device, tmp_path):
    """The trainer's run, as the recipe assembles it, with trainer.precision=bf16: the
    lowered program multiplies bf16 operands, and the loss curve follows fp32's closely
    without being the same numbers."""
    from hydra import compose, initialize_config_dir

    from tpu_train import cli, trainer
    from tpu_train.trainer.config import register_schema

    register_schema()
    overrides = [*COMMON, *LAYOUTS["fsdp8"], "trainer.precision=bf16", f"run.dir={tmp_path}"]
    with initialize_config_dir(config_dir=cli.CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    job = trainer.start(cfg)
    run = trainer.assemble(job, bundled="prose")  # as recipes/llama_pretrain.py
    step, model = run.step_fn, run.model
    step.place()
    batches = iter(run.data.train)
    losses = [float(step(next(batches))["loss"]) for _ in range(STEPS)]
    (program,) = step.compiled.cache.entries.values()
    text = program.lowered.as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots and sum("bf16" in line for line in dots) >= len(dots) // 2, dots[:4]
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    fp32 = one_device[0]
    assert losses == pytest.approx(fp32, rel=BF16_REL)
    assert losses != fp32


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _processes_naming(text: str) -> list[int]:
    """PIDs of live processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def _assert_one_writer(run_dir: Path, steps: int = STEPS) -> None:
    """Process 0 alone wrote the run: one opening block and one row per step."""
    lines = (run_dir / "train.log").read_text().splitlines()
    # Console lines carry the time they were written ("2026-12-04 08:51:02 device: ...").
    assert sum(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d device: ", line) is not None
               for line in lines) == 1, lines
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "train/loss" in r]) == steps


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_two_processes_train_one_model_then_resume_on_one(one_device, tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "tpu_train.launch", "--nproc", "2", "-m", "tpu_train.cli",
               *COMMON, *LAYOUTS["fsdp8"], "checkpoint.every_n_steps=2", f"run.dir={run_dir}"]
    output = open(tmp_path / "launcher.log", "w")
    launcher = subprocess.Popen(command, env=_env(4), stdout=output, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: (run_dir / "checkpoints" / "step_00000002").is_dir()
                  or launcher.poll() is not None, 300, "the step-2 checkpoint")
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        # The ranks die with their launcher (nothing outlives the job).
        _wait_for(lambda: not _processes_naming(str(run_dir)), 30, "the ranks to exit")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        output.close()
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["layout"] == "sharded", meta
    shards = sorted(p.name for p in (checkpoint / "sharded").iterdir() if p.suffix == ".distcp")
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # each process wrote its own shards
    first = read_metrics(run_dir)
    assert 2 <= max(first) < STEPS, (sorted(first), (tmp_path / "launcher.log").read_text()[-3000:])
    # Resumed by ONE process over all 8 devices: the run continues with the same losses.
    code, out, err = run_in_process(*COMMON, *LAYOUTS["fsdp8"], "checkpoint.every_n_steps=2",
                                    f"run.dir={run_dir}")
    assert code == 0, err
    assert "(resumed from step_" in out
    assert _losses(run_dir) == pytest.approx(one_device[0], rel=REL)


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    """(run directory, finished process) of ``torchrun`` training one model in two processes of
    4 devices each, a sharded checkpoint every 2 steps. One launch serves the run's own checks
    and the one-device resume from its step-2 checkpoint (a launch is ~1 minute on 2 cores)."""
    run_dir = tmp_path_factory.mktemp("torchrun") / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "tpu_train.cli", *COMMON,
               *LAYOUTS["tp2_fsdp4_scanned"][:3],  # layers unrolled
               "checkpoint.every_n_steps=2", "checkpoint.keep_last=3", f"run.dir={run_dir}"]
    # As from a user's shell: importing jax in this test process set TF_CPP_MIN_LOG_LEVEL=1
    # in its environment, which tpu-train would respect.
    env = {k: v for k, v in _env(4).items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    return run_dir, done


# The timeouts count the fixtures' child processes where a test is the first to need them
# (run alone, or picked with -k): the one-device run and the launch, up to 300 s each.
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_torchrun_two_processes_one_run_dir(one_device, torchrun_run):
    run_dir, done = torchrun_run
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert "(8 devices, 2 processes)" in done.stdout
    assert [p.name for p in run_dir.parent.iterdir()] == ["run"]
    _assert_one_writer(run_dir)
    assert _losses(run_dir) == pytest.approx(one_device[0], rel=REL)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_sharded_checkpoint_resumes_on_one_device(one_device, torchrun_run, tmp_path):
    """Two processes (tensor=2 x fsdp=4) write sharded checkpoints; one process on ONE device
    resumes from the step-2 one and replays steps 3-6 with the losses of a run on one device
    throughout. The eager step cannot hold a sharded checkpoint: one line names the setting to
    change."""
    launched, done = torchrun_run
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    run_dir = tmp_path / "run"
    shutil.copytree(launched, run_dir)  # the launch's own directory stays as it wrote it
    common = [*COMMON, "checkpoint.every_n_steps=2", "checkpoint.keep_last=3", f"run.dir={run_dir}"]
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    assert json.loads((checkpoint / "meta.json").read_text())["layout"] == "sharded"
    # The processes' library noise stays off the console (logging.verbose=false), their own
    # lines do not: Gloo connects at each sharded save, the coordination service at start-up.
    assert "[Gloo]" not in done.stdout and "finished step 6/6" in done.stdout, done.stdout
    assert "coordination_service" not in done.stderr, done.stderr

    code, out, err = run_in_process(*common, "trainer.mode=eager", "trainer.device=cpu",
                                    "parallel.data=1", "checkpoint.load_step=2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "is a sharded checkpoint" in err and "set trainer.mode=compiled trainer.device=tpu" in err

    done = subprocess.run([sys.executable, "-m", "tpu_train.cli", *common, "parallel.data=-1",
                           "checkpoint.load_step=2"], env=_env(1), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mesh data=1 fsdp=1 tensor=1 (1 device, 1 process)" in done.stdout
    assert "(resumed from step_00000002)" in done.stdout
    assert _losses(run_dir) == pytest.approx(one_device[0], rel=REL)


# Eager FSDP2 over processes is the slow path (op by op, each process on its own core): 2
# processes, 3 steps; four (fsdp=4, tensor x fsdp) train in tests/parallel/test_per_device.py.
EAGER_STEPS = 3
EAGER = [*COMMON[:-3], f"trainer.max_steps={EAGER_STEPS}", "trainer.mode=eager",
         "trainer.device=tpu"]
EAGER_REL = loss_rtol(torch.float32, EAGER_STEPS, reduction=768, depth=4)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_torchrun_eager_fsdp2_over_the_tpu_group_matches_one_device(tmp_path):
    """One device per process: PyTorch's own FSDP2 over the project's ``tpu`` process group."""
    reference = tmp_path / "one_device"
    code, out, err = run_in_process(*EAGER, f"run.dir={reference}")
    assert code == 0, err
    run_dir = tmp_path / "fsdp2"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "tpu_train.cli", *EAGER, "parallel.data=1",
               "parallel.fsdp=2", f"run.dir={run_dir}"]
    done = subprocess.run(command, env=_env(1), capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert "mesh data=1 fsdp=2 tensor=1 (2 devices, 2 processes), FSDP2" in done.stdout
    _assert_one_writer(run_dir, EAGER_STEPS)
    assert _losses(run_dir, EAGER_STEPS) == pytest.approx(_losses(reference, EAGER_STEPS),
                                                          rel=EAGER_REL)
    # Parameters and AdamW moments: each process holds half (FSDP2 pads uneven shards).
    assert _param_bytes(run_dir) <= 0.55 * _param_bytes(reference)
