"""A model named ``ORG/NAME`` (or ``ORG/NAME@revision``) on the Hugging Face Hub, as a local
directory: ``huggingface_hub.snapshot_download`` into its cache, only the files a model is
built from (config, safetensors weights, tokenizer files).

The token comes from where ``huggingface_hub`` looks (``HF_TOKEN``, the token file that
``hf auth login`` writes). ``HF_HUB_OFFLINE=1`` reads the cache only, and ``HF_HUB_CACHE`` (or
``HF_HOME``) names the cache, both as set when the model is resolved. Every failure is a
:class:`HubError` of one line that says what to do.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# What a model is built from; the rest of a repository (other weight formats, ONNX, GGUF,
# images) is never downloaded.
MODEL_FILES = [
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja",
]

# ORG/NAME as the Hub spells repository ids, optionally @revision (a branch, tag or commit).
_REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^\s@]+))?")
_TRUE = {"1", "on", "yes", "true"}


class HubError(ValueError):
    """A Hub model that cannot be had; the message is one line."""


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str | None  # None: the default branch

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_model_id(value: str) -> HubModel | None:
    """``ORG/NAME[@revision]`` as a :class:`HubModel`; None for anything else (a path)."""
    match = _REPO_ID.fullmatch(value)
    if match is None or value.startswith(".") or ".." in match["repo"]:
        return None
    return HubModel(match["repo"], match["revision"])


def offline() -> bool:
    """``HF_HUB_OFFLINE`` as set now (``huggingface_hub`` reads it once, at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> Path:
    """The Hub cache as the environment names it now."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def download(model: HubModel, setting: str = "model.checkpoint") -> Path:
    """The local snapshot directory of ``model`` (downloaded unless cached and offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{setting}={model}"
    try:
        directory = Path(snapshot_download(model.repo_id, revision=model.revision,
                                           cache_dir=cache_dir(), allow_patterns=MODEL_FILES,
                                           local_files_only=offline()))
    except GatedRepoError:
        raise HubError(f"{where} is a gated model: accept its terms on the model's Hub page, then "
                       "log in (hf auth login) or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise HubError(f"{where}: no such model on the Hugging Face Hub and no such local "
                       "directory (a private model needs a token: hf auth login or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"{where}: the Hub has no revision {model.revision!r} of "
                       f"{model.repo_id}; name a branch, tag or commit it has") from None
    except LocalEntryNotFoundError:
        if offline():
            raise HubError(f"{where} is not in the Hugging Face cache ({cache_dir()}) and "
                           "HF_HUB_OFFLINE=1 forbids downloading it; download it once without "
                           "HF_HUB_OFFLINE, or point it at a local directory") from None
        raise HubError(f"{where}: the Hugging Face Hub cannot be reached and the model is not "
                       f"in the cache ({cache_dir()}); check the network, or point it at a "
                       "local directory") from None
    except ValueError as exc:  # huggingface_hub's check of the repository id or revision
        raise HubError(f"{where}: {str(exc).strip().splitlines()[0]}") from None
    except OSError as exc:  # a cache that cannot be written, a broken download
        detail = str(exc).strip().splitlines()
        raise HubError(f"{where}: {type(exc).__name__}: {detail[0] if detail else 'no detail'}") from None
    if not (directory / "config.json").is_file():
        raise HubError(f"{where} has no config.json: not a transformers model repository")
    return directory
