"""Build what a recipe needs from the configuration: device, tokenizer, data, model.

Everything here only reads; nothing is written to the run directory, so a failure leaves an
existing run untouched.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from omegaconf import DictConfig

from .checkpoint import is_checkpoint, read_model_state
from .errors import ConfigError

# The bundled corpus's training files: prose for pretraining, the synthetic instruction task
# (validated on tasks_heldout.jsonl) for fine-tuning. A recipe names the one it trains on.
BUNDLED_TRAIN_FILES = {"prose": "pretrain.jsonl", "tasks": "tasks_train.jsonl"}


def resolve_device(name: str) -> torch.device:
    """``trainer.device`` as a torch device (``tpu`` needs the tpu_train device backend)."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "tpu":
        import tpu_train

        factory = getattr(tpu_train, "device", None)
        if not callable(factory):
            raise ConfigError(
                "trainer.device=tpu needs the tpu_train device backend (tpu_train.device), which "
                "this installation does not provide; use trainer.device=cpu"
            )
        return torch.device(factory(0))
    raise ConfigError(f"trainer.device={name!r} is not a device; valid devices: cpu, tpu")


def data_paths(cfg: DictConfig, bundled: str = "tasks") -> tuple[Path, Path | None]:
    """(training file, validation file or None); ``data.path: null`` means the bundled corpus's
    ``bundled`` training file (:data:`BUNDLED_TRAIN_FILES`)."""
    from tpu_train.data import default_corpus_dir

    if cfg.data.path is not None:
        val = Path(cfg.data.val_path) if cfg.data.val_path is not None else None
        return Path(cfg.data.path), val
    corpus = default_corpus_dir()
    train = corpus / BUNDLED_TRAIN_FILES[bundled]
    val = Path(cfg.data.val_path) if cfg.data.val_path is not None else corpus / "tasks_heldout.jsonl"
    return train, val


def build_tokenizer(cfg: DictConfig):
    from tpu_train.data import load_tokenizer

    return load_tokenizer(cfg.data.tokenizer)


def build_train_loader(cfg: DictConfig, tokenizer, path: Path):
    """An endless, resumable loader of packed ``{"tokens", "labels"}`` batches."""
    from tpu_train.data import PackedLoader

    loader = PackedLoader(path, tokenizer, cfg.data.seq_len, cfg.data.batch_size,
                          format=cfg.data.format, mask_prompt=cfg.data.mask_prompt,
                          shuffle_buffer=cfg.data.shuffle_buffer, seed=cfg.trainer.seed)
    # Read the first batch now so that bad records fail before the run directory is touched.
    probe = PackedLoader(path, tokenizer, cfg.data.seq_len, cfg.data.batch_size,
                         format=cfg.data.format, mask_prompt=cfg.data.mask_prompt)
    next(iter(probe))
    return loader


def build_val_loader(cfg: DictConfig, tokenizer, path: Path | None, probe: bool = True):
    """A finite loader over the validation file (one pass), or None.

    A loader is a single stream, so every validation pass needs a new one.  With ``probe`` a
    separate loader first reads one batch, so that bad records fail before anything is written.
    """
    from tpu_train.data import PackedLoader

    if path is None:
        return None

    def make():
        return PackedLoader(path, tokenizer, cfg.data.seq_len, cfg.data.batch_size,
                            format=cfg.data.format, mask_prompt=cfg.data.mask_prompt,
                            num_epochs=1, drop_last=False)

    if probe:
        next(iter(make()))
    return make()


def first_record_kind(path: Path | None) -> str | None:
    """``text``, ``instruction`` or ``chat``: the kind of the file's first record."""
    from tpu_train.data import read_records

    if path is None:
        return None
    for chunk in read_records(path, chunk_lines=1):
        return chunk[0].example.kind
    return None


def _architecture(config) -> dict:
    fields = dataclasses.asdict(config)
    fields.pop("max_seq_len", None)
    fields.pop("rope_scaling", None)
    return fields


def build_model(cfg: DictConfig, vocab_size: int, allow_checkpoint: bool = True):
    """The Llama of ``model.name`` on the CPU, loaded from ``model.checkpoint`` when set.

    ``model.checkpoint`` may be a Hugging Face directory or one of our ``step_N`` checkpoints;
    either way only the parameters are loaded.
    """
    from tpu_train.models import Llama, from_pretrained, get_config

    config = get_config(cfg.model.name)
    if vocab_size > config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {vocab_size} tokens but model {cfg.model.name} has vocab_size "
            f"{config.vocab_size}; use a matching data.tokenizer or model"
        )
    checkpoint = cfg.model.checkpoint if allow_checkpoint else None
    if checkpoint is not None and not is_checkpoint(Path(checkpoint)):
        model = from_pretrained(checkpoint, dtype=torch.float32, device="cpu")
        if _architecture(model.config) != _architecture(config):
            raise ConfigError(
                f"model.checkpoint={checkpoint!r} holds a different architecture than "
                f"model={cfg.model.name}; select the matching model group option"
            )
        return model
    with torch.device("meta"):
        model = Llama(config)
    model.init_weights(seed=cfg.trainer.seed, device="cpu")
    if checkpoint is not None:
        state = read_model_state(checkpoint)
        try:
            model.load_state_dict(state, strict=False)
        except RuntimeError as exc:
            raise ConfigError(
                f"model.checkpoint={checkpoint!r} does not fit model={cfg.model.name}: "
                f"{str(exc).splitlines()[0]}"
            ) from exc
    return model
