"""Every job of a multirun checked before the first one starts.

Hydra's sweeper writes ``multirun.yaml`` into the sweep directory and starts job 0 before it
composes job 1, so a bad value in the second job of ``tpu-train -m optim.lr=1e-3,-1`` would
leave a finished run and a sweep file behind. Composing and validating each job's
configuration first makes a bad sweep a one-line error that writes nothing.
"""

from __future__ import annotations

import itertools

from .validation import validate_config

MULTIRUN_FLAGS = ("-m", "--multirun")
_VALUE_FLAGS = {"--config-dir": "dir", "-cd": "dir", "--config-name": "name", "-cn": "name"}


def _split_command_line(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the overrides, the config dir/name flags) of a Hydra command line."""
    overrides, flags, pending = [], {}, None
    for arg in args:
        if pending is not None:
            flags[pending], pending = arg, None
        elif arg in _VALUE_FLAGS:
            pending = _VALUE_FLAGS[arg]
        elif arg.startswith("--config-dir="):
            flags["dir"] = arg.partition("=")[2]
        elif arg.startswith("--config-name="):
            flags["name"] = arg.partition("=")[2]
        elif not arg.startswith("-"):
            overrides.append(arg)
    return overrides, flags


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The override list of each job of a sweep, in Hydra's order (the cartesian product of
    the comma / range sweeps, the last override varying fastest)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(job) for job in itertools.product(*choices)]


def check_sweep(args: list[str], config_dir: str, config_name: str) -> None:
    """Compose and validate every job of ``tpu-train -m args...``; raise on the first bad one."""
    from hydra import compose, initialize_config_dir

    overrides, flags = _split_command_line(args)
    if "dir" in flags:  # the user's --config-dir is searched like Hydra's own run does
        overrides = [*overrides, f"hydra.searchpath=[file://{flags['dir']}]"]
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        for job in sweep_jobs(overrides):
            validate_config(compose(config_name=flags.get("name", config_name), overrides=job))
