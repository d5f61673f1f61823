"""The model families this process knows: found by family or config name, model, config or
Hugging Face ``model_type``.

The built-in families are listed in :func:`_built_in` and registered on the first lookup; a
family of the user's own joins them with :func:`register_family`, after which ``tpu-train
model.name=<one of its configs>`` trains it. No torch is imported here (the command line
checks names before torch is imported).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .spec import ModelFamily

__all__ = ["checkpoint_family", "config_names", "families", "family_for_hf", "family_named",
           "family_of", "named_config", "register_family", "unregister_family"]

_FAMILIES: dict[str, ModelFamily] = {}


def _built_in() -> tuple[ModelFamily, ...]:
    from .llama.spec import LLAMA
    from .mixtral.spec import MIXTRAL

    return (LLAMA, MIXTRAL)


def _registered() -> dict[str, ModelFamily]:
    if not _FAMILIES:
        for family in _built_in():
            _add(family)
    return _FAMILIES


def _add(family: ModelFamily) -> None:
    taken = {}
    for other in _FAMILIES.values():
        if other.name == family.name:
            continue
        taken.update({other.name: other.name, **{c: other.name for c in other.configs}})
    clash = sorted(n for n in (family.name, *family.configs) if n in taken)
    if clash:
        raise ValueError(f"family {family.name}: the names {clash} are already taken by "
                         f"{', '.join(sorted({taken[n] for n in clash}))}; rename them")
    _FAMILIES[family.name] = family


def register_family(family: ModelFamily) -> ModelFamily:
    """Make ``family`` known (again: registering a family of the same name replaces it).

    Its name and config names must not be another family's; returns ``family``.
    """
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family takes a tpu_train.models.ModelFamily, got "
                        f"{type(family).__name__}")
    _registered()
    _add(family)
    return family


def unregister_family(name: str) -> None:
    """Forget the family called ``name`` (a built-in one comes back on the next lookup only
    if no family is left)."""
    if _registered().pop(name, None) is None:
        raise KeyError(f"no model family named {name!r}; families: "
                       f"{', '.join(f.name for f in families())}")


def families() -> tuple[ModelFamily, ...]:
    return tuple(_registered().values())


def config_names() -> list[str]:
    """Every named config of every family, sorted."""
    return sorted(name for family in families() for name in family.configs)


def family_named(name: str) -> ModelFamily:
    """The family called ``name`` or owning the config called ``name``."""
    for family in families():
        if name == family.name or name in family.configs:
            return family
    raise KeyError(f"no model family or config named {name!r}; families: "
                   f"{', '.join(f.name for f in families())}; configs: "
                   f"{', '.join(config_names())}")


def named_config(name: str, **overrides) -> Any:
    """The config called ``name`` (of whichever family has it), fields replaced by
    ``overrides``."""
    return family_named(name).config(name, **overrides)


def family_of(model_or_config: Any) -> ModelFamily:
    """The family of a model (by its ``.config``) or of a config object itself: the family
    whose ``config_class`` is the config's class or its nearest base class."""
    config = getattr(model_or_config, "config", model_or_config)
    # The most specific config class first: a family may extend another's config (Mixtral's
    # is a LlamaConfig with experts).
    for cls in type(config).__mro__:
        for family in families():
            if family.config_class is cls:
                return family
    what = type(model_or_config).__name__
    raise LookupError(f"no model family for {what} (config {type(config).__name__}); "
                      f"families: {', '.join(f.name for f in families())} (add one with "
                      "tpu_train.models.register_family)")


def family_for_hf(model_type: Any, source: str = "config.json") -> ModelFamily:
    """The family that reads Hugging Face checkpoints of ``model_type``."""
    for family in families():
        if family.hf is not None and model_type in family.hf.model_types:
            return family
    known = sorted(t for f in families() if f.hf is not None for t in f.hf.model_types)
    raise ValueError(f"{source}: model_type {model_type!r} is not supported; supported: "
                     f"{', '.join(known)}")


def checkpoint_family(directory: str | Path) -> ModelFamily:
    """The family of a Hugging Face directory, by its config.json's ``model_type``.

    Raises ``FileNotFoundError``/``ValueError`` with one line naming the file: no config.json,
    unreadable JSON, or an architecture no family reads.
    """
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: expected a Hugging Face model directory "
                                "containing config.json and safetensors weights")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    try:
        return family_for_hf(model_type, source=str(path))
    except ValueError:
        known = sorted(t for f in families() if f.hf is not None for t in f.hf.model_types)
        raise ValueError(f"{path}: unsupported architecture (model_type={model_type!r}, "
                         f"architectures={config.get('architectures') or []}); supported "
                         f"model types: {', '.join(known)}") from None
