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
    """``trainer.device`` as a torch device (``tpu`` needs the tpu_train device backend).

    The ``tpu`` backend is opened on a thread of its own
    (:func:`tpu_train.device.runtime.open_in_background`): the tokenizer, the data and the
    model are read on the host meanwhile, and the first use of the device waits for it (an
    unusable platform is reported there, before the run directory is written). ``tpu-train``
    started it already, while it imported (:mod:`tpu_train.startup`)."""
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
        from tpu_train.device import runtime

        runtime.open_in_background()
        return torch.device("tpu", 0)
    raise ConfigError(f"trainer.device={name!r} is not a device; valid devices: cpu, tpu")


def synthetic_tokens(cfg: DictConfig) -> bool:
    """Whether ``data.source`` is ``synthetic_tokens`` (random ids; no files)."""
    from .config import DataSource

    return DataSource(cfg.data.source) is DataSource.synthetic_tokens


def build_random_token_loader(cfg: DictConfig):
    """Endless batches of random ids of the model's vocabulary, seeded by ``trainer.seed``."""
    from tpu_train.data import RandomTokenLoader

    try:
        return RandomTokenLoader(model_config(cfg).vocab_size, cfg.data.seq_len,
                                 cfg.data.batch_size, seed=cfg.trainer.seed)
    except ValueError as exc:
        raise ConfigError(f"data=synthetic_tokens with trainer.seed={cfg.trainer.seed}: {exc}; "
                          "choose a smaller trainer.seed") from None


def data_paths(cfg: DictConfig, bundled: str = "tasks", tokenizer=None):
    """(training files, validation files or None) as ``DataFiles`` carrying ``data.column_map``
    and ``data.template`` (``auto`` resolved with ``tokenizer``; without one, ``none``);
    ``data.path: null`` means the bundled corpus's ``bundled`` training file
    (:data:`BUNDLED_TRAIN_FILES`). ``data.path`` without ``data.val_path`` holds out
    ``data.holdout`` of its records for validation (:func:`holdout_split`).
    ``data=synthetic_tokens`` has no files: a ConfigError."""
    from tpu_train.data import default_corpus_dir
    from tpu_train.data.datasets import resolve_template
    from tpu_train.data.sources import DataFiles

    if synthetic_tokens(cfg):
        raise ConfigError(
            f"recipe={cfg.recipe.name} reads data files, but data=synthetic_tokens generates "
            "random token ids; choose data=jsonl data.path=... (or data=bundled)")

    column_map = dict(cfg.data.column_map or {})
    template = resolve_template(cfg.data.template, tokenizer) if tokenizer is not None else "none"

    def files(value):
        if value is None:
            return None
        listed = value if isinstance(value, (str, Path)) else list(value)
        return DataFiles.of(listed, column_map).with_options(template=template)

    if cfg.data.path is not None:
        train, val = files(cfg.data.path), files(cfg.data.val_path)
        if val is None and cfg.data.holdout > 0:
            return holdout_split(train, cfg.data.holdout, cfg.data.format)
        return train, val
    corpus = default_corpus_dir()
    train = files(corpus / BUNDLED_TRAIN_FILES[bundled])
    val = files(cfg.data.val_path if cfg.data.val_path is not None else corpus / "tasks_heldout.jsonl")
    return train, val


# The split's seed: fixed, so that runs with different trainer.seed validate on the same records.
HOLDOUT_SEED = 0
# Fewer records than this in data.path: no held-out split (a handful of records would make a
# noisy figure and cost the training set records it cannot spare).
MIN_HOLDOUT_RECORDS = 100


def holdout_split(files, fraction: float, fmt: str = "auto"):
    """(the records of ``files`` trained on, the held-out ``fraction`` validated on): a seeded
    hash of each record's file name and line decides, the same in every process and run.
    ``(files, None)`` when ``files`` hold fewer than :data:`MIN_HOLDOUT_RECORDS` records or
    none falls in the held-out fraction."""
    from tpu_train.data.sources import Holdout

    held_out = files.with_options(holdout=Holdout(fraction, held_out=True, seed=HOLDOUT_SEED))
    if _count_records(files, fmt, MIN_HOLDOUT_RECORDS) < MIN_HOLDOUT_RECORDS \
            or _count_records(held_out, fmt, 1) == 0:
        return files, None
    return files.with_options(holdout=Holdout(fraction, held_out=False, seed=HOLDOUT_SEED)), held_out


def _count_records(files, fmt: str, at_most: int) -> int:
    """How many records ``files`` hold, counting no further than ``at_most``."""
    count = 0
    for index in range(len(files.paths)):
        for chunk in files.read(index, fmt, chunk_lines=at_most):
            count += len(chunk)
            if count >= at_most:
                return count
    return count


def hf_checkpoint(cfg: DictConfig) -> Path | None:
    """``model.checkpoint`` when it is a Hugging Face directory (not one of our ``step_N``)."""
    checkpoint = cfg.model.checkpoint
    if checkpoint is None or is_checkpoint(Path(checkpoint)):
        return None
    return Path(checkpoint)


def is_bundled_model(directory: Path) -> bool:
    """Whether ``directory`` is the base model shipped in tpu_train/assets (bundled tokenizer)."""
    from .config import asset_path

    return directory.resolve() == Path(asset_path("base_model")).resolve()


def model_family(cfg: DictConfig):
    """The model family to build: the one reading a Hugging Face ``model.checkpoint``'s
    config.json, else the one owning the named config ``model.name``."""
    from tpu_train.models import checkpoint_family, family_named

    directory = hf_checkpoint(cfg)
    if directory is None:
        return family_named(cfg.model.name)
    try:
        return checkpoint_family(directory)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.checkpoint: {exc}") from None


def model_config(cfg: DictConfig):
    """The architecture to build: a Hugging Face ``model.checkpoint``'s config.json, else the
    named preset ``model.name``, with ``model.n_layers`` / ``model.max_seq_len`` (and a
    mixture of experts' ``model.moe_impl``) applied. Bad
    checkpoint directories are one-line ConfigErrors."""
    from tpu_train.planning.estimate import architecture_overrides

    family = model_family(cfg)
    directory = hf_checkpoint(cfg)
    if directory is None:
        config = family.config(cfg.model.name)
    else:
        try:
            config = family.hf.read_config(directory)[1]
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.checkpoint: {exc}") from None
    config = dataclasses.replace(config, **architecture_overrides(cfg.model))
    impl = cfg.model.get("moe_impl")
    if impl is None:
        return config
    if not hasattr(config, "moe_impl"):
        what = "model.checkpoint" if directory is not None else f"model={cfg.model.name}"
        raise ConfigError(f"model.moe_impl={impl} applies to a mixture-of-experts model; "
                          f"{what} has no experts: drop model.moe_impl")
    return dataclasses.replace(config, moe_impl=impl)


def build_tokenizer(cfg: DictConfig):
    """``data.tokenizer``; else a Hugging Face ``model.checkpoint``'s own tokenizer
    (tokenizer.json, else tokenizer.model, with its special tokens); else the bundled one (the
    bundled base model's, and the one for training from scratch). A tokenizer that can produce
    ids beyond the model's embedding rows is a ConfigError."""
    from tpu_train.data.tokenizer import HF_TOKENIZER_FILE, SENTENCEPIECE_FILE, load_tokenizer

    path, where = cfg.data.tokenizer, "data.tokenizer"
    directory = hf_checkpoint(cfg)
    if path is None and directory is not None and not is_bundled_model(directory):
        if not any((directory / name).is_file() for name in (HF_TOKENIZER_FILE, SENTENCEPIECE_FILE)):
            raise ConfigError(
                f"model.checkpoint={str(directory)!r} holds no tokenizer ({HF_TOKENIZER_FILE} or "
                f"{SENTENCEPIECE_FILE}); add the checkpoint's tokenizer files or set data.tokenizer")
        path, where = directory, "the tokenizer of model.checkpoint"
    tokenizer = load_tokenizer(path)
    rows = model_config(cfg).vocab_size
    if tokenizer.vocab_size > rows:
        model = (f"model.checkpoint ({directory / 'config.json'})" if directory is not None
                 else f"model {cfg.model.name}")
        raise ConfigError(
            f"{where} ({tokenizer.path}) has {tokenizer.vocab_size} tokens but {model} has "
            f"vocab_size {rows} embedding rows: ids >= {rows} would be out of range; use the "
            "model's own tokenizer")
    return tokenizer


def build_train_loader(cfg: DictConfig, tokenizer, files):
    """An endless, resumable loader of packed ``{"tokens", "labels"}`` batches (a mixture of
    the files when ``data.weights`` is set)."""
    from tpu_train.data import PackedLoader

    weights = None if cfg.data.weights is None else list(cfg.data.weights)
    loader = PackedLoader(files, tokenizer, cfg.data.seq_len, cfg.data.batch_size,
                          format=cfg.data.format, mask_prompt=cfg.data.mask_prompt,
                          shuffle_buffer=cfg.data.shuffle_buffer, seed=cfg.trainer.seed,
                          weights=weights, document_masking=cfg.data.packing)
    # Read the first batch now so that bad records fail before the run directory is touched.
    probe = PackedLoader(files, tokenizer, cfg.data.seq_len, cfg.data.batch_size,
                         format=cfg.data.format, mask_prompt=cfg.data.mask_prompt)
    next(iter(probe))
    _read_first_records(cfg, loader.files)
    return loader


def _read_first_records(cfg: DictConfig, files) -> None:
    """Parse every file's first record: a first batch may not reach a later or rarely drawn
    file, whose bad columns would otherwise stop the run midway."""
    for index in range(len(files.paths)):
        next(files.read(index, cfg.data.format, chunk_lines=1))


def build_val_loader(cfg: DictConfig, tokenizer, files, probe: bool = True):
    """A finite loader over the validation files (one pass, in order), or None.

    A loader is a single stream, so every validation pass needs a new one.  With ``probe`` a
    separate loader first reads one batch, so that bad records fail before anything is written.
    """
    from tpu_train.data import PackedLoader

    if files is None:
        return None

    def make():
        return PackedLoader(files, tokenizer, cfg.data.seq_len, cfg.data.batch_size,
                            format=cfg.data.format, mask_prompt=cfg.data.mask_prompt,
                            num_epochs=1, drop_last=False, document_masking=cfg.data.packing)

    if probe:
        first = make()
        _read_first_records(cfg, first.files)
        next(iter(first))
    return make()


def first_record_kind(files) -> str | None:
    """``text``, ``instruction`` or ``chat``: the kind of the first file's first record."""
    from tpu_train.data.sources import first_record_kind as kind

    return kind(files)


def build_model(cfg: DictConfig, vocab_size: int, allow_checkpoint: bool = True,
                dtype: torch.dtype = torch.float32):
    """The model on the CPU, built by its family: the architecture of a Hugging Face
    ``model.checkpoint`` (its config.json) or of the named preset ``model.name``; loaded from
    ``model.checkpoint`` when set and ``allow_checkpoint``, else seeded random initialization.

    ``model.checkpoint`` may be a Hugging Face directory or one of our ``step_N`` checkpoints
    (of the ``model.name`` architecture); either way only the parameters are loaded.
    ``dtype``: the weights'.
    """
    family = model_family(cfg)
    config = model_config(cfg)
    directory = hf_checkpoint(cfg)
    _check_vocab(cfg, vocab_size, config, directory)
    checkpoint = cfg.model.checkpoint if allow_checkpoint else None
    if checkpoint is not None and directory is not None:
        return _load_hf(cfg, dtype=dtype, device="cpu")
    with torch.device("meta"):
        model = family.build(config).to(dtype)
    model = family.init_weights(model, cfg.trainer.seed, "cpu")
    if checkpoint is not None:
        state = _read_step_checkpoint(checkpoint)
        try:
            model.load_state_dict(state, strict=False)
        except RuntimeError as exc:
            raise ConfigError(
                f"model.checkpoint={checkpoint!r} does not fit model={cfg.model.name}: "
                f"{str(exc).splitlines()[0]}"
            ) from exc
    return model


def build_quantized_model(cfg: DictConfig, vocab_size: int, prepare,
                          allow_checkpoint: bool = True):
    """The model :func:`build_model` builds, laid out by ``prepare`` (adapted, its frozen
    linear weights made int8: run on the model while it is on the ``meta`` device) and then
    filled on the CPU a tensor at a time (:func:`tpu_train.models.streaming.materialize_quantized`):
    the whole model never exists in a float dtype, from a seeded initialization or a Hugging
    Face checkpoint alike. A family without ``initial_values`` (or, for a checkpoint,
    ``hf.read_weights``) is built whole in bfloat16 and then given to ``prepare``."""
    from tpu_train.models.streaming import materialize_quantized

    family = model_family(cfg)
    config = model_config(cfg)
    directory = hf_checkpoint(cfg)
    _check_vocab(cfg, vocab_size, config, directory)
    checkpoint = cfg.model.checkpoint if allow_checkpoint else None
    from_hf = checkpoint is not None and directory is not None
    if family.initial_values is None or (from_hf and family.hf.read_weights is None):
        return prepare(build_model(cfg, vocab_size, allow_checkpoint, dtype=torch.bfloat16))
    if from_hf:
        skeleton = _load_hf(cfg, dtype=torch.float32, device="meta")
    else:
        with torch.device("meta"):
            skeleton = family.build(config)
    base = {name: param for name, param in skeleton.named_parameters()}
    model = prepare(skeleton)
    if from_hf:
        values = family.hf.read_weights(directory, base)
    else:
        shapes = [(name, tuple(param.shape)) for name, param in base.items()]
        values = family.initial_values(skeleton.config, shapes, cfg.trainer.seed)
    try:
        model = materialize_quantized(model, base, values)
    except (OSError, ValueError) as exc:  # the checkpoint's, found as it is read
        if not from_hf:
            raise
        raise ConfigError(f"model.checkpoint: {str(exc).splitlines()[0]}") from None
    if checkpoint is not None and not from_hf:
        # Our own checkpoint overrides the initialization where it has the parameter.
        _write_step_checkpoint(model, base, _read_step_checkpoint(checkpoint), cfg)
    return model


def _write_step_checkpoint(model, base: dict, state: dict, cfg: DictConfig) -> None:
    """Write the parameters of ``state`` (a ``step_N`` checkpoint's) that ``base`` names into
    an int8-base ``model``, as ``load_state_dict(strict=False)`` would into the float one."""
    from tpu_train.models.streaming import QuantizedWriter

    writer = QuantizedWriter(model)
    for name, value in state.items():
        if name not in base:
            continue
        if tuple(value.shape) != tuple(base[name].shape):
            raise ConfigError(
                f"model.checkpoint={cfg.model.checkpoint!r} does not fit model={cfg.model.name}: "
                f"{name} has shape {list(value.shape)}, the model's {list(base[name].shape)}")
        writer.write(name, None, value)


def _check_vocab(cfg: DictConfig, vocab_size: int, config, directory) -> None:
    if vocab_size > config.vocab_size:
        model = (f"model.checkpoint ({directory / 'config.json'})" if directory is not None
                 else f"model {cfg.model.name}")
        raise ConfigError(
            f"the tokenizer has {vocab_size} tokens but {model} has vocab_size "
            f"{config.vocab_size}; use a matching data.tokenizer or model"
        )


def _load_hf(cfg: DictConfig, *, dtype, device):
    """The Hugging Face ``model.checkpoint`` (on ``meta``: its skeleton, nothing read)."""
    try:
        model = model_family(cfg).hf.load(hf_checkpoint(cfg), dtype=dtype, device=device,
                                          max_seq_len=cfg.model.get("max_seq_len"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.checkpoint: {str(exc).splitlines()[0]}") from None
    if cfg.model.get("moe_impl") is not None:  # the checkpoint's config has its own
        model.use_moe_impl(model_config(cfg).moe_impl)
    return model


def _read_step_checkpoint(checkpoint) -> dict:
    try:
        return read_model_state(checkpoint)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.checkpoint: {exc}") from None


def export_pretrained(model, directory: Path, tokenizer, state_dict: dict | None = None) -> None:
    """The run's Hugging Face export: weights, config.json and generation_config.json with the
    tokenizer's special ids, and the tokenizer files, all world-readable, so that
    ``transformers.AutoModelForCausalLM`` and ``AutoTokenizer`` load ``directory``."""
    import stat

    from tpu_train.models import family_of

    family = family_of(model)
    if family.hf is None:
        raise ConfigError(f"model family {family.name} has no Hugging Face format; set "
                          "checkpoint.export_hf=false")
    family.hf.save(model, directory, bos_token_id=tokenizer.bos_id,
                   eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                   state_dict=state_dict)
    tokenizer.save_pretrained(directory)
    readable = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(path.stat().st_mode | readable)
