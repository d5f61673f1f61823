"""Turn Hydra/OmegaConf composition errors into one actionable line.

Hydra reports a typo as several lines without the keys that would have been valid; a user
fixing a command wants one line that names the bad key and lists the alternatives.
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from .config import Config


def _valid_keys(parent_key: str) -> list[str] | None:
    schema = OmegaConf.structured(Config)
    node: Any = schema if not parent_key else OmegaConf.select(schema, parent_key)
    if isinstance(node, DictConfig):
        return sorted(str(k) for k in node.keys())
    return None


def _flatten(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines()]
    return " ".join(line for line in lines if line)


def _omegaconf_cause(exc: BaseException) -> OmegaConfBaseException | None:
    seen = exc
    while seen is not None:
        if isinstance(seen, OmegaConfBaseException):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def describe_composition_error(exc: BaseException) -> str:
    """One line (no newline) explaining why the configuration could not be composed."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(exc, OverrideParseException):
        first = str(exc).splitlines()[0].strip()
        return f"cannot parse the override '{exc.override}': {first} (see 'tpu-train --help')"

    if isinstance(exc, MissingConfigException) and getattr(exc, "options", None):
        group = str(getattr(exc, "missing_cfg_file", "") or "")
        group_name, _, choice = group.rpartition("/")
        return (
            f"unknown {group_name or 'config'} option '{choice or group}'; valid options: "
            f"{', '.join(sorted(exc.options))}"
        )
    cause = _omegaconf_cause(exc)
    unknown = re.search(r"Could not override '([^'@]+)'", str(exc))
    full_key = str(cause.full_key) if isinstance(cause, ConfigKeyError) else ""
    if unknown or (isinstance(cause, ConfigKeyError) and full_key):
        full_key = unknown.group(1) if unknown else full_key
        parent, _, key = full_key.rpartition(".")
        valid = _valid_keys(parent)
        while valid is None and parent:
            parent = parent.rpartition(".")[0]
            valid = _valid_keys(parent)
        where = f"section '{parent}'" if parent else "the top level"
        if valid is not None:
            return f"unknown key '{full_key}': {where} has keys {', '.join(valid)}"
        return f"unknown key '{full_key}'"
    if isinstance(cause, ValidationError) and cause.full_key:
        first = str(cause).splitlines()[0].strip()
        return f"bad value for '{cause.full_key}': {first}"
    if cause is not None and cause is not exc:
        return f"{_flatten(exc)} ({_flatten(cause).split(' full_key:')[0]})"
    return _flatten(exc).split(" full_key:")[0]
