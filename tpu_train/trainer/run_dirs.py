"""Which run directory a command resumes (``run.dir=latest``), and the command that resumes
a stopped run, printed with its concrete ``run.dir`` (the default one is a timestamp, so
"the same command" would start a new run)."""

from __future__ import annotations

import shlex
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError
from .storage_urls import RunPath, is_local, is_url, modified_time, run_path, url_problem

# Not config.yaml: ``--config-dir RUN --config-name config`` would then pick it instead of the
# packaged primary config.
SAVED_CONFIG_FILE = "run_config.yaml"
# Where default run directories go: runs/<recipe.name>/<timestamp> (RunConfig.dir).
RUNS_ROOT = "runs"
LATEST = "latest"
# Overrides a resume command leaves out: the run directory (given concretely) and the step to
# go back to (resuming continues from the newest checkpoint).
_NOT_REPEATED = ("run.dir", "checkpoint.load_step")


def unfinished_progress(run_dir: RunPath) -> tuple[int, int] | None:
    """(newest checkpoint step, its trainer.max_steps) of a run that stopped before its end;
    None for a finished run, one without a checkpoint or without a readable run_config.yaml."""
    # Here, not at the top: the command line resolves run.dir before it imports torch.
    from .checkpoint import checkpoint_dirs

    found = checkpoint_dirs(run_dir)
    if not found:
        return None
    try:
        saved = OmegaConf.create((run_dir / SAVED_CONFIG_FILE).read_text())
        max_steps = int(saved.trainer.max_steps)
    except Exception:  # noqa: BLE001 - not a run directory of ours: not a candidate
        return None
    step = max(step for step, _ in found)
    return (step, max_steps) if step < max_steps else None


def latest_root(run_dir: str) -> RunPath | None:
    """Where ``run.dir=latest`` looks: ``runs/<recipe>`` for ``latest``, ``URL`` for
    ``URL/latest`` (run directories at a URL); None for any other ``run.dir``."""
    if run_dir == LATEST:
        return None
    head, _, tail = run_dir.rstrip("/").rpartition("/")
    if tail != LATEST or not is_url(run_dir):
        return None
    problem = url_problem(run_dir)
    if problem is not None:
        raise ConfigError(f"run.dir={run_dir!r}: {problem}")
    return run_path(head)


def resolve_latest(cfg: DictConfig) -> str | None:
    """``run.dir=latest``: the newest unfinished run of this recipe under ``runs/<recipe>/``
    (the one whose newest checkpoint was written last) becomes ``run.dir``; likewise
    ``run.dir=URL/latest`` among the run directories under ``URL``. Returns the note that says
    which, or None when ``run.dir`` is neither."""
    text = str(cfg.run.dir)
    root = Path(RUNS_ROOT) / str(cfg.recipe.name) if text == LATEST else latest_root(text)
    if root is None:
        return None
    from .checkpoint import checkpoint_dirs

    of_recipe = f"of recipe {cfg.recipe.name} " if text == LATEST else ""
    candidates = []
    for run_dir in sorted(root.iterdir(), key=str) if root.is_dir() else []:
        progress = unfinished_progress(run_dir) if run_dir.is_dir() else None
        if progress is not None:
            newest = max(checkpoint_dirs(run_dir), key=lambda found: found[0])[1]
            candidates.append((_written_at(newest), str(run_dir), progress))
    if not candidates:
        raise ConfigError(
            f"run.dir={text}: no unfinished run {of_recipe}under {root}/ (a run "
            "directory whose newest checkpoint is before its trainer.max_steps); give the run "
            "directory itself, run.dir=DIR")
    _, run_dir, (step, max_steps) = max(candidates)
    cfg.run.dir = run_dir
    return f"note: run.dir={text}: resuming {run_dir} from step {step} of {max_steps}"


def _written_at(checkpoint: RunPath) -> float:
    """When a checkpoint was completed: its directory's time locally (renamed into place
    complete), its ``meta.json``'s at a URL (written last; an object store has no directories)."""
    from .checkpoint import META_FILE

    return modified_time(checkpoint if is_local(checkpoint) else checkpoint / META_FILE)


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


def resume_command(run_dir: RunPath, processes: int = 1) -> str:
    """The command that resumes this run: this one's overrides with ``run.dir`` concrete."""
    config_args, overrides = _command_line_overrides()
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in _NOT_REPEATED]
    command = " ".join(shlex.quote(arg) for arg in
                       ["tpu-train", *config_args, *kept, f"run.dir={run_dir}"])
    if processes > 1:
        command += f" (in each of the {processes} processes, under the same launcher)"
    return command
