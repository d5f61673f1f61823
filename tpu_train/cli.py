"""``tpu-train``: the command line of tpu_train, a Hydra app over the ``configs/`` tree.

Usage::

    tpu-train                                   # recipe=llama_finetune on a tiny Llama, bundled data, CPU
    tpu-train recipe=llama_pretrain trainer.max_steps=500 scheduler=wsd
    tpu-train recipe=llama_lora model=llama3_2_1b model.checkpoint=/ckpt/Llama-3.2-1B \\
              data=jsonl data.path=train.jsonl data.val_path=val.jsonl
    tpu-train recipe=eval run.dir=runs/llama_finetune/2025-01-01_00-00-00
    tpu-train recipe=generate model.checkpoint=runs/llama_finetune/<stamp>/hf \\
              'recipe.generate.prompts=["add 12+30\\n"]'
    tpu-train -m trainer.seed=1,2               # multirun: one run per seed, <run.dir>/<job number>
    tpu-train --cfg job                          # print the composed config and exit
    tpu-train --help                             # recipes and config groups
    tpu-train plan model=llama3_1_8b parallel.fsdp=256 plan.chip=v5e
                                                 # per-chip memory and step time of a pod
                                                 # config: analytic and XLA's, no chips needed
                                                 # (recipe=plan is the same command)

Recipes (``recipe=NAME``): the scripts in the top-level ``recipes/`` (installed as the
``tpu_train_recipes`` package); each ``configs/recipe/NAME.yaml`` starts with the command that
runs it. ``recipe=./my_recipe.py`` runs a user's copy of one: it composes the config its
``RECIPE_CONFIG`` names (default ``llama_finetune``) and calls its ``main(cfg)``.

* ``llama_pretrain``: random initialization, WSD schedule; ``model.checkpoint`` must be unset.
* ``llama_finetune`` (default): all parameters train; ``model.checkpoint`` (a Hugging Face
  directory) is loaded parameters-only when set.
* ``llama_lora``: the base model is frozen and ``recipe.lora.{rank,alpha,dropout,targets}``
  adapters wrap the attention and MLP projections; the exported model has them merged.
* ``generate``: greedy or sampled continuations of ``recipe.generate.prompts``.
* ``eval``: validation loss, perplexity and exact match on instruction/chat validation data.

Config groups: ``model`` (debug_tiny, llama3_2_1b, llama3_1_8b, ...), ``data`` (bundled,
jsonl), ``optim`` (adamw, adamw_finetune, adamw_lora),
``scheduler`` (warmup_cosine, wsd, constant), ``parallel``, ``checkpoint``, ``logging``,
``recipe``; plain sections ``trainer`` (max_steps, seed, mode=eager|fused|compiled, device=cpu|tpu,
precision=fp32|bf16, grad_accum_steps, max_grad_norm,
remat=none|full|save_dots|save_qkv_proj|offload, val_every_n_steps, on_nan=stop|skip), ``run``
(dir) and ``plan`` (chip).

Runs: everything a run writes goes under ``run.dir`` (default ``runs/<recipe>/<timestamp>``):
``checkpoints/step_NNNNNNNN/`` (atomic; the last ``checkpoint.keep_last`` are kept),
``tensorboard/``, ``train.log`` and, at the end, ``hf/`` (a Hugging Face export). Starting a
command on a directory that holds a checkpoint resumes it exactly (model, optimizer, schedule,
RNG and data position); ``run.dir=latest`` names the newest unfinished run of the recipe.
SIGINT/SIGTERM save a checkpoint and exit cleanly, printing the command that resumes (with its
concrete ``run.dir``); a non-finite loss
stops the run (or skips the update with ``trainer.on_nan=skip``) keeping the last good checkpoint.

Errors in the configuration or the data are reported as one line,
``tpu-train: error: ...``, with exit status 2, before anything is written.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import runpy
import string
import sys
from importlib import resources
from pathlib import Path

import hydra
from omegaconf import DictConfig

from tpu_train.startup import PLAN_COMMAND, exit_promptly, load_runtime
from tpu_train.trainer.config import register_schema
from tpu_train.trainer.config_errors import describe_composition_error
from tpu_train.trainer.errors import ConfigError, TrainingStopped
from tpu_train.trainer.run_dirs import resolve_latest
from tpu_train.trainer.sweep import MULTIRUN_FLAGS, check_sweep
from tpu_train.trainer.validation import validate_settings

# configs/ and recipes/ sit at the top of the source tree and are installed as the packages
# tpu_train_configs and tpu_train_recipes (see pyproject.toml), so the same lookup works from a
# checkout, an editable install and a wheel. Hydra wants an absolute config path.
CONFIG_PACKAGE, RECIPES_PACKAGE = "tpu_train_configs", "tpu_train_recipes"
_SOURCE_TREE = Path(__file__).resolve().parent.parent
if importlib.util.find_spec(CONFIG_PACKAGE) is None:
    # A source checkout that was not pip-installed: the packages are its top-level folders.
    _spec = importlib.util.spec_from_file_location(
        CONFIG_PACKAGE, _SOURCE_TREE / "configs" / "__init__.py")
    sys.modules[CONFIG_PACKAGE] = importlib.util.module_from_spec(_spec)
    _spec = importlib.util.spec_from_file_location(
        RECIPES_PACKAGE, _SOURCE_TREE / "recipes" / "__init__.py")
    sys.modules[RECIPES_PACKAGE] = importlib.util.module_from_spec(_spec)
CONFIG_DIR = str(resources.files(CONFIG_PACKAGE))
DEFAULT_RECIPE_CONFIG = "llama_finetune"

EXIT_BAD_INPUT = 2
EXIT_STOPPED = 1
_SCRIPT_OVERRIDE = "recipe.script"


def recipe_names() -> list[str]:
    """The recipes shipped with tpu_train (``recipe=NAME``)."""
    return sorted(entry.name[:-3] for entry in resources.files(RECIPES_PACKAGE).iterdir()
                  if entry.name.endswith(".py") and not entry.name.startswith("_"))


def _recipe_script(cfg: DictConfig) -> Path:
    if cfg.recipe.script is not None:
        return Path(cfg.recipe.script)
    name = cfg.recipe.name
    if name not in recipe_names():
        raise ConfigError(
            f"recipe.name={name!r} is not a recipe; valid names: {', '.join(recipe_names())} "
            "(select one with recipe=NAME, or run your own with recipe=./my_recipe.py)")
    return Path(str(resources.files(RECIPES_PACKAGE) / f"{name}.py"))


def run_recipe(cfg: DictConfig) -> None:
    """Run the recipe script of ``cfg`` (``recipe.script``, else ``recipes/<recipe.name>.py``)."""
    script = _recipe_script(cfg)
    namespace = runpy.run_path(str(script), run_name="tpu_train_recipe")
    main = namespace.get("main")
    if not callable(main):
        raise ConfigError(f"{script} defines no main(cfg); a recipe script needs one")
    main(cfg)


def _declared_config(script: Path) -> str:
    """The ``RECIPE_CONFIG = "..."`` of a recipe script (read without running it)."""
    try:
        tree = ast.parse(script.read_text(encoding="utf-8"), filename=str(script))
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        raise ConfigError(f"recipe={script}: cannot read the recipe script ({exc})") from exc
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "RECIPE_CONFIG"
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return node.value.value
    return DEFAULT_RECIPE_CONFIG


def _script_overrides(argv: list[str]) -> list[str]:
    """``recipe=path/to/file.py`` becomes ``recipe=<its RECIPE_CONFIG> recipe.script=<path>``."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and not key.lstrip("+~").strip():
            raise ConfigError(f"override {arg!r} names no key; write KEY=VALUE, e.g. "
                              "trainer.max_steps=3")
        if key == "recipe" and sep and value.endswith(".py"):
            script = Path(value).expanduser().resolve()
            if not script.is_file():
                raise ConfigError(f"recipe={value}: no such recipe script")
            out += [f"recipe={_declared_config(script)}", f"{_SCRIPT_OVERRIDE}={script}"]
        else:
            out.append(arg)
    return out


def _check_before_loading(cfg: DictConfig) -> None:
    """The recipe exists, and for a shipped one, the first checks its ``trainer.start`` makes
    (:func:`validate_settings`, on a copy): run before torch and JAX are imported, so that a
    bad value is answered at once. A user's recipe script is left to its own checks."""
    _recipe_script(cfg)
    if cfg.recipe.script is not None or cfg.recipe.name == PLAN_COMMAND:
        return
    ahead = cfg.copy()
    resolve_latest(ahead)
    validate_settings(ahead)


def _run_job(cfg: DictConfig) -> None:
    # Errors are reported here rather than after Hydra's job wrapper, which would print an
    # extra "Error executing job" line first.
    try:
        _check_before_loading(cfg)
        load_runtime()
        run_recipe(cfg)
    except Exception as exc:  # noqa: BLE001 - _exit_for re-raises what is not bad input
        _exit_for(exc)


def _run_plan_job(cfg: DictConfig) -> None:
    # ``tpu-train plan`` and ``recipe=plan`` both land here; recipes/plan.py is the same call.
    # Imported here: other commands' start-up does not pay for the planner's compile stack.
    try:
        load_runtime()
    except Exception as exc:  # noqa: BLE001 - _exit_for re-raises what is not bad input
        _exit_for(exc)
    from tpu_train.planning import command

    try:
        command.plan_job(cfg)
    except (ValueError, KeyError) as exc:  # bad degrees, batch, chip or model name
        _exit_for(ConfigError(str(exc).strip("'\"")))
    except Exception as exc:  # noqa: BLE001 - _exit_for re-raises what is not bad input
        _exit_for(exc)


# The environment's errors, raised while tpu_train's runtime is imported (load_runtime) or
# first used (a bad TPU_TRAIN_PLATFORM, no such devices, an unusable cache directory): matched
# by name, since importing their classes would re-run the import that failed.
_ENVIRONMENT_ERRORS = {"tpu_train.device.runtime.PlatformError",
                       "tpu_train.device.compilation_cache.CompilationCacheError",
                       "tpu_train.device.lazy.EagerModeError"}


# Bad data: matched by name too, since importing tpu_train.data for its class would import
# torch into a command that found a typo before it imported it.
_DATA_ERRORS = {"tpu_train.data.errors.DataError"}


def _is_bad_input(exc: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    names = {f"{cls.__module__}.{cls.__qualname__}" for cls in type(exc).__mro__}
    if names & (_ENVIRONMENT_ERRORS | _DATA_ERRORS):
        return True
    return isinstance(exc, (ConfigError, HydraException, OmegaConfBaseException))


_HELP_FLAGS = (["--help"], ["-h"])
_HYDRA_GROUP = "hydra"


def _config_groups_help(root: Path) -> str:
    """Hydra's ``$APP_CONFIG_GROUPS`` for the config tree at ``root``: one ``group: options``
    line per folder of YAML files (its subfolders as ``group/sub``), sorted, the ``hydra``
    groups left out."""
    groups: dict[str, list[str]] = {}
    for path in root.rglob("*.yaml"):
        group = path.parent.relative_to(root).as_posix()
        if group != "." and "__pycache__" not in group.split("/") and not (
                group == _HYDRA_GROUP or group.startswith(f"{_HYDRA_GROUP}/")):
            groups.setdefault(group, []).append(path.stem)
    return "".join(f"{group}: {', '.join(sorted(set(options)))}\n"
                   for group, options in sorted(groups.items()))


def _quick_help() -> str | None:
    """The text Hydra prints for a bare ``tpu-train --help``, rendered without composing the
    configuration: Hydra composes it, then lists every config group through a deep copy of its
    config store per group (most of a second of CPU). None where the help template needs more
    than ``configs/config.yaml``'s own ``hydra.help`` and ``$APP_CONFIG_GROUPS`` (Hydra then
    prints it; tests/test_cli.py compares the two)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        template = OmegaConf.load(Path(CONFIG_DIR) / "config.yaml").hydra.help.template
        return string.Template(template).substitute(
            APP_CONFIG_GROUPS=_config_groups_help(Path(CONFIG_DIR)))
    except (OmegaConfBaseException, KeyError, ValueError):
        return None


def main() -> None:
    """Console entry point (``tpu-train``)."""
    if sys.argv[1:] in _HELP_FLAGS:
        text = _quick_help()
        if text is not None:
            print(text)
            return
    register_schema()
    # Hydra prints its own multi-line reports unless asked to re-raise; we want one line.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    job, saved_argv = _run_job, sys.argv
    try:
        args = _script_overrides(sys.argv[1:])
        if args and args[0] == PLAN_COMMAND:
            # ``tpu-train plan <overrides>``: the same config tree, the plan recipe; Hydra
            # parses the rest of the command line as usual.
            job, args = _run_plan_job, args[1:]
        if f"recipe={PLAN_COMMAND}" in args:
            # ``recipe=plan`` is the same command (plan is listed among the recipes).
            job, args = _run_plan_job, [a for a in args if a != f"recipe={PLAN_COMMAND}"]
        if any(flag in args for flag in MULTIRUN_FLAGS):
            check_sweep(args, CONFIG_DIR, "config")
        sys.argv = [sys.argv[0], *args]
        app = hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")(job)
        app()
    except Exception as exc:  # noqa: BLE001 - _exit_for re-raises what is not bad input
        _exit_for(exc)
    finally:
        sys.argv = saved_argv


def _exit_for(exc: Exception) -> None:
    """Print a one-line report and exit for bad input or a stopped run; re-raise anything else.
    The exit does not wait for a backend still opening (:func:`tpu_train.startup.exit_promptly`)."""
    if isinstance(exc, TrainingStopped):
        exit_promptly(EXIT_STOPPED, f"tpu-train: stopped: {exc}")
    if not _is_bad_input(exc):
        raise exc
    message = str(exc) if isinstance(exc, ConfigError) else describe_composition_error(exc)
    exit_promptly(EXIT_BAD_INPUT, f"tpu-train: error: {' '.join(message.split())}")


if __name__ == "__main__":
    main()
