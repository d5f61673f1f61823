"""Which run directory a command resumes (``run.dir=latest``), and the command that resumes
a stopped run, printed with its concrete ``run.dir`` (the default one is a timestamp, so
"the same command" would start a new run)."""

from __future__ import annotations

import shlex
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError

# Not config.yaml: ``--config-dir RUN --config-name config`` would then pick it instead of the
# packaged primary config.
SAVED_CONFIG_FILE = "run_config.yaml"
# Where default run directories go: runs/<recipe.name>/<timestamp> (RunConfig.dir).
RUNS_ROOT = "runs"
LATEST = "latest"
# Overrides a resume command leaves out: the run directory (given concretely) and the step to
# go back to (resuming continues from the newest checkpoint).
_NOT_REPEATED = ("run.dir", "checkpoint.load_step")


def unfinished_progress(run_dir: Path) -> tuple[int, int] | None:
    """(newest checkpoint step, its trainer.max_steps) of a run that stopped before its end;
    None for a finished run, one without a checkpoint or without a readable run_config.yaml."""
    # Here, not at the top: the command line resolves run.dir before it imports torch.
    from .checkpoint import checkpoint_dirs

    found = checkpoint_dirs(run_dir)
    if not found:
        return None
    try:
        max_steps = int(OmegaConf.load(run_dir / SAVED_CONFIG_FILE).trainer.max_steps)
    except Exception:  # noqa: BLE001 - not a run directory of ours: not a candidate
        return None
    step = max(step for step, _ in found)
    return (step, max_steps) if step < max_steps else None


def resolve_latest(cfg: DictConfig) -> str | None:
    """``run.dir=latest``: the newest unfinished run of this recipe under ``runs/<recipe>/``
    (the one whose newest checkpoint was written last) becomes ``run.dir``. Returns the note
    that says which, or None when ``run.dir`` is not ``latest``."""
    if str(cfg.run.dir) != LATEST:
        return None
    from .checkpoint import checkpoint_dirs

    root = Path(RUNS_ROOT) / str(cfg.recipe.name)
    candidates = []
    for run_dir in sorted(root.iterdir()) if root.is_dir() else []:
        progress = unfinished_progress(run_dir) if run_dir.is_dir() else None
        if progress is not None:
            newest = max(checkpoint_dirs(run_dir))[1]
            candidates.append((newest.stat().st_mtime, str(run_dir), progress))
    if not candidates:
        raise ConfigError(
            f"run.dir=latest: no unfinished run of recipe {cfg.recipe.name} under {root}/ (a run "
            "directory whose newest checkpoint is before its trainer.max_steps); give the run "
            "directory itself, run.dir=DIR")
    _, run_dir, (step, max_steps) = max(candidates)
    cfg.run.dir = run_dir
    return f"note: run.dir=latest: resuming {run_dir} from step {step} of {max_steps}"


def _command_line_overrides() -> tuple[list[str], list[str]]:
    """(``--config-dir``/``--config-name`` arguments, key=value overrides) of this job."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return [], []
    hydra = HydraConfig.get()
    config_args = []
    for source in hydra.runtime.config_sources:
        if source.provider == "command-line":
            config_args += ["--config-dir", str(source.path).removeprefix("file://")]
    if hydra.job.config_name and hydra.job.config_name != "config":
        config_args += ["--config-name", hydra.job.config_name]
    return config_args, list(hydra.overrides.task)


def resume_command(run_dir: Path, processes: int = 1) -> str:
    """The command that resumes this run: this one's overrides with ``run.dir`` concrete."""
    config_args, overrides = _command_line_overrides()
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in _NOT_REPEATED]
    command = " ".join(shlex.quote(arg) for arg in
                       ["tpu-train", *config_args, *kept, f"run.dir={run_dir}"])
    if processes > 1:
        command += f" (in each of the {processes} processes, under the same launcher)"
    return command
