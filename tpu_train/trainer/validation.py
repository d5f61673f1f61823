"""Checks of the composed configuration that the schema's types cannot express.

They run before anything is built or written, and each failure names the key, the value and
what would be accepted.
"""

from __future__ import annotations

import math
from pathlib import Path

from omegaconf import DictConfig

from .config import OPTIMIZERS, Remat, ScheduleName, StateDtype, StepMode
from .errors import ConfigError

DEVICES = ("cpu", "tpu")
DATA_FORMATS = ("auto", "text", "instruction", "chat")
MAX_HOLDOUT = 0.5


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive(cfg: DictConfig, key: str) -> None:
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, key)
    _require(value is not None and value >= 1, f"{key} must be >= 1, got {value}")


def _reject_unknown_keys(cfg: DictConfig) -> None:
    """``+section.key=...`` adds keys the schema does not know (Hydra's ``+`` bypasses struct
    mode): such a typo must fail like a misspelt existing key instead of being ignored."""
    import dataclasses

    from .config import Config

    def walk(node, schema, prefix: str) -> None:
        fields = {f.name: f for f in dataclasses.fields(schema)}
        for key in node.keys():
            path = f"{prefix}{key}"
            if key not in fields:
                raise ConfigError(
                    f"{path} is not a setting (added with +{path}=...?); valid keys of "
                    f"{prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(fields))}")
            sub = _dataclass_of(schema, key)
            if sub is not None and isinstance(node[key], DictConfig):
                walk(node[key], sub, f"{path}.")

    walk(cfg, Config, "")


def _dataclass_of(schema, key: str):
    import dataclasses
    import typing

    hint = typing.get_type_hints(schema).get(key)
    return hint if dataclasses.is_dataclass(hint) else None


def _validate_parallel(cfg: DictConfig) -> None:
    for axis in ("data", "fsdp", "expert", "tensor"):
        degree = cfg.parallel[axis]
        _require(degree == -1 or degree >= 1,
                 f"parallel.{axis} must be -1 (infer) or >= 1, got {degree}")
    # data=-1 (the default) yields to an explicit fsdp=-1 or tensor=-1 (trainer.parallelism).
    inferred = [a for a in ("fsdp", "expert", "tensor") if cfg.parallel[a] == -1]
    _require(len(inferred) <= 1,
             f"at most one of parallel.{' and parallel.'.join(inferred)} may be -1 (infer from "
             "the device count); set the others explicitly")
    _validate_context(cfg)


def _validate_context(cfg: DictConfig) -> None:
    """``parallel.context``: sequences split over devices in the compiled SPMD step only, in
    2 x context equal chunks (the zig-zag layout), without packed rows' document masks."""
    context = cfg.parallel.context
    _require(context >= 1, f"parallel.context must be >= 1 (devices each sequence is split "
                           f"over), got {context}")
    if context == 1:
        return
    mode = StepMode(cfg.trainer.mode)
    _require(mode is StepMode.compiled,
             f"parallel.context={context} splits sequences in the compiled SPMD step; "
             f"trainer.mode={mode.value} has none: use trainer.mode=compiled, or "
             "parallel.context=1")
    _require(not cfg.data.packing,
             f"parallel.context={context} does not support data.packing=true (packed rows' "
             "document masks); set data.packing=false or parallel.context=1")
    check_context_seq_len(cfg.data.seq_len, context)


def check_context_seq_len(seq_len, context: int) -> None:
    """``data.seq_len`` (once known) must split into ``2 x parallel.context`` equal chunks."""
    _require(seq_len is None or context == 1 or seq_len % (2 * context) == 0,
             f"data.seq_len={seq_len} does not split into 2 x parallel.context = "
             f"{2 * context} equal chunks (the zig-zag layout of context parallelism); make "
             f"data.seq_len a multiple of {2 * context}")


def _validate_run_dir(cfg: DictConfig) -> None:
    """``run.dir`` must name a directory this process can create or write, checked before
    anything is written (a file there, or a file or unwritable directory above it, fails)."""
    import os

    from .storage_urls import run_path, url_problem

    raw = cfg.run.dir
    _require(raw is not None and str(raw).strip() != "",
             "run.dir is empty; name the directory the run writes into (e.g. run.dir=runs/ft)")
    problem = url_problem(str(raw))  # a URL: its filesystem must be installed (gcsfs, ...)
    _require(problem is None, f"run.dir={str(raw)!r}: {problem}")
    path = run_path(str(raw))
    if not isinstance(path, Path):
        _probe_url(path, str(raw))
        return
    path = path.expanduser().absolute()
    _require(not path.exists() or path.is_dir(),
             f"run.dir={str(raw)!r} is a file, not a directory; choose another run.dir")
    existing = path
    while not existing.exists():
        existing = existing.parent
    _require(existing.is_dir(),
             f"run.dir={str(raw)!r} lies under {str(existing)!r}, which is a file; choose "
             "another run.dir")
    _require(os.access(existing, os.W_OK | os.X_OK),
             f"run.dir={str(raw)!r}: {str(existing)!r} is not writable; choose a directory "
             "you can write to")
    if existing != path:
        # Permission bits do not tell everything: a pseudo-filesystem (/proc, /sys) or a
        # read-only mount refuses new directories. An empty directory made and removed at once
        # is the one reliable test.
        import tempfile

        try:
            os.rmdir(tempfile.mkdtemp(prefix=".tpu-train-probe-", dir=existing))
        except OSError as exc:
            raise ConfigError(
                f"run.dir={str(raw)!r}: no directory can be created under {str(existing)!r} "
                f"({exc.strerror or exc}); choose a directory on a writable filesystem") from None


def _probe_url(path, raw: str) -> None:
    """A run directory at a URL must take a write: an object written and removed at once (a
    missing bucket, no credentials or no permission fail here, before the run starts)."""
    import uuid

    probe = path / f".tpu-train-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except Exception as exc:  # noqa: BLE001 - each store raises its own errors
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no detail"
        raise ConfigError(f"run.dir={raw!r}: cannot write there ({type(exc).__name__}: "
                          f"{detail}); check the bucket's name and your access to it") from None


def _validate_logging_and_checkpoint(cfg: DictConfig) -> None:
    profile = cfg.logging.profile_steps
    _require(profile is None or (len(profile) == 2 and 1 <= profile[0] <= profile[1]),
             f"logging.profile_steps must be [first, last] with 1 <= first <= last, got "
             f"{None if profile is None else list(profile)}")
    _require(cfg.checkpoint.load_step is None or cfg.checkpoint.load_step >= 1,
             f"checkpoint.load_step must be >= 1 or null (the newest), got {cfg.checkpoint.load_step}")


def _data_paths(data: DictConfig, key: str) -> list[str]:
    """``data.<key>`` as a list of paths (a single path or a list; none for null)."""
    from omegaconf import ListConfig

    value = data[key]
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    _require(isinstance(value, ListConfig) and len(value) > 0
             and all(isinstance(p, str) and p for p in value),
             f"data.{key} must be a path or a non-empty list of paths, e.g. data.{key}=[a.jsonl,b.parquet]; "
             f"got {value!r}")
    return list(value)


def _validate_data_paths(data: DictConfig) -> None:
    """data.path / data.val_path exist; data.weights and data.column_map have their shapes."""
    from omegaconf import ListConfig

    for key in ("path", "val_path"):
        for path in _data_paths(data, key):
            _require(Path(path).exists(),
                     f"data.{key}={path!r} does not exist; give an existing path or null for the bundled one")
    if data.weights is not None:
        paths = _data_paths(data, "path")
        _require(isinstance(data.path, ListConfig),
                 "data.weights needs a list of files in data.path (one weight per file), "
                 f"e.g. data.path=[a.jsonl,b.parquet] data.weights=[0.7,0.3]; data.path is {data.path!r}")
        _require(len(data.weights) == len(paths),
                 f"data.weights has {len(data.weights)} values but data.path has {len(paths)} files; "
                 "give one weight per file")
        for index, weight in enumerate(data.weights):
            _require(0 < weight < float("inf"),
                     f"data.weights[{index}]={weight} (for {paths[index]}) must be positive; drop the "
                     "file from data.path instead of giving it no weight")
    column_map = data.column_map
    _require(column_map is None or isinstance(column_map, DictConfig),
             f"data.column_map must map our fields to the file's columns, e.g. "
             f"data.column_map={{prompt:question,response:answer}}; got {column_map!r}")


def _validate_data_sources(data: DictConfig) -> None:
    """data.path / data.val_path are sources the readers know; data.column_map names our fields."""
    from omegaconf import OmegaConf

    from tpu_train.data.errors import DataError
    from tpu_train.data.sources import check_column_map, source_kind

    for key in ("path", "val_path"):
        for path in _data_paths(data, key):
            try:
                source_kind(path)
            except DataError as exc:
                raise ConfigError(f"data.{key}: {exc}") from None
    column_map = data.column_map
    try:
        check_column_map(OmegaConf.to_container(column_map) if column_map is not None else {})
    except ValueError as exc:
        raise ConfigError(f"data.{exc}") from None


def _validate_synthetic_tokens(data: DictConfig) -> None:
    """``data.source=synthetic_tokens`` reads no files: a file setting beside it is a mistake
    (the run would silently ignore the user's data)."""
    from .config import DataSource

    if DataSource(data.source) is not DataSource.synthetic_tokens:
        return
    for key in ("path", "val_path", "weights", "column_map"):
        _require(data[key] is None,
                 f"data.{key}={data[key]!r} is set, but data.source=synthetic_tokens trains on "
                 f"random token ids and reads no files; drop data.{key}, or choose data=jsonl "
                 "data.path=... to train on files")
    _require(not data.packing,
             "data.packing=true keeps packed samples apart, but data.source=synthetic_tokens "
             "trains on random token ids with no samples; drop data.packing, or choose "
             "data=jsonl data.path=... to train on files")


def validate_settings(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for the first invalid value that can be told from ``cfg``
    alone, without torch, JAX or the data files' readers: the command line runs this before it
    imports them, so that a bad value is answered at once (:func:`validate_config` runs it
    too)."""
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    _require(not missing, f"{', '.join(missing)} must be set (e.g. data.path=/data/train.jsonl "
                          "for data=jsonl)")
    for key in ("trainer.max_steps", "trainer.grad_accum_steps", "trainer.val_batches",
                "checkpoint.every_n_steps", "checkpoint.keep_last", "logging.every_n_steps",
                "data.batch_size"):
        _positive(cfg, key)
    _validate_trainer(cfg.trainer)
    _validate_optimizer(cfg.optim, cfg.scheduler)
    _validate_parallel(cfg)
    _validate_model_and_data(cfg)
    _validate_synthetic_tokens(cfg.data)
    _validate_data_paths(cfg.data)
    _validate_logging_and_checkpoint(cfg)
    _validate_run_dir(cfg)
    _reject_unknown_keys(cfg)
    _validate_recipe_settings(cfg.recipe)
    from .saved_step import check_options

    check_options(cfg)


def validate_config(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for the first invalid value in ``cfg``: those of
    :func:`validate_settings`, then those that need the runtime, the model's architecture or
    the data files' readers."""
    validate_settings(cfg)
    _validate_trainer_for_the_runtime(cfg.trainer)
    _validate_base_dtype(cfg)
    _validate_seq_len_for_the_model(cfg)
    _validate_data_sources(cfg.data)


def _validate_trainer(trainer) -> None:
    _require(trainer.seed >= 0, f"trainer.seed must be >= 0, got {trainer.seed}")
    _require(trainer.device in DEVICES,
             f"trainer.device={trainer.device!r} is not a device; valid devices: {', '.join(DEVICES)}")
    _require(StepMode(trainer.mode) is not StepMode.compiled or trainer.device == "tpu",
             f"trainer.mode=compiled needs trainer.device=tpu (the compiled step is one program on "
             f"the tpu device), got trainer.device={trainer.device!r}; use trainer.mode=eager on the CPU")
    _require(StepMode(trainer.mode) is not StepMode.fused or trainer.device == "tpu",
             f"trainer.mode=fused needs trainer.device=tpu (fused eager mode records tpu ops), got "
             f"trainer.device={trainer.device!r}; use trainer.mode=eager on the CPU")
    _require(trainer.cpu_threads is None or trainer.cpu_threads >= 1,
             f"trainer.cpu_threads must be >= 1 or null (PyTorch's default), got {trainer.cpu_threads}")
    _require(trainer.micro_batch_size is None or trainer.micro_batch_size >= 1,
             f"trainer.micro_batch_size must be >= 1 or null (all of a device's rows at once), "
             f"got {trainer.micro_batch_size}")
    _require(trainer.loss_chunk_tokens is None or trainer.loss_chunk_tokens >= 1,
             f"trainer.loss_chunk_tokens must be >= 1 or null (from the vocabulary: a chunk's "
             f"float32 logits within 256 MiB), got {trainer.loss_chunk_tokens}")
    _require(trainer.val_every_n_steps >= 0,
             f"trainer.val_every_n_steps must be >= 0 (0 disables validation), got {trainer.val_every_n_steps}")
    _require(trainer.max_minutes is None or trainer.max_minutes > 0,
             f"trainer.max_minutes must be > 0 or null (no limit), got {trainer.max_minutes}")
    _require(trainer.max_grad_norm is None or trainer.max_grad_norm > 0,
             f"trainer.max_grad_norm must be > 0 or null (no clipping), got {trainer.max_grad_norm}")
    _validate_offload(trainer)


def _validate_offload(trainer) -> None:
    """``trainer.remat=offload`` moves the inputs of scanned layers in the compiled step."""
    if getattr(trainer.remat, "value", trainer.remat) != Remat.offload.value:
        return
    _require(StepMode(trainer.mode) is StepMode.compiled,
             f"trainer.remat=offload moves layer inputs to host memory in the compiled step; "
             f"trainer.mode={StepMode(trainer.mode).value} does not: use trainer.remat=full")
    _require(trainer.scan_layers is True,
             "trainer.remat=offload moves the inputs of scanned layers to host memory: set "
             "trainer.scan_layers=true")


def _validate_trainer_for_the_runtime(trainer) -> None:
    if StepMode(trainer.mode) is StepMode.fused:
        from tpu_train.device.lazy import EagerModeError, region_size_from_environment

        try:
            region_size_from_environment()
        except EagerModeError as error:
            raise ConfigError(str(error)) from None
    if trainer.max_minutes is not None:
        from .world import requested_world_size

        # Each process would reach its own deadline at a different step, and a checkpoint
        # needs them all: the limit is for a job of one process.
        _require(requested_world_size() == 1,
                 "trainer.max_minutes stops a job of one process; under a launcher set "
                 "trainer.max_steps instead (or stop the job with SIGTERM: it saves and resumes)")
    if remat_policy(trainer) == Remat.offload.value:
        import jax

        from tpu_train.compile.remat_regions import host_offload_problem

        problem = host_offload_problem(jax.devices())
        _require(problem is None, problem)


def _validate_base_dtype(cfg: DictConfig) -> None:
    """An int8 base lives in one program's arguments or in one process's model: FSDP2 and
    DTensor (eager modes under a launcher) shard float parameters only."""
    from .config import BaseDtype

    if BaseDtype(cfg.model.base_dtype) is not BaseDtype.int8 \
            or StepMode(cfg.trainer.mode) is StepMode.compiled:
        return
    from .world import requested_world_size

    _require(requested_world_size() == 1,
             f"model.base_dtype=int8 with trainer.mode={StepMode(cfg.trainer.mode).value} under a "
             "launcher: the per-process layout (FSDP2) does not shard int8 weights; use "
             "trainer.mode=compiled (one program over every device) or model.base_dtype=param")


def remat_policy(trainer) -> str:
    """``trainer.remat`` as a policy name, ``trainer.activation_checkpointing=true`` read as
    ``full``; both set, differently, is a :class:`ConfigError`."""
    from tpu_train.parallel.activation_checkpointing import remat_setting

    try:
        return remat_setting(trainer.remat, trainer.get("activation_checkpointing", False))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def state_dtype_problem(name: str, state_dtype) -> str | None:
    """Why ``optim.state_dtype`` cannot apply to ``optim.name`` (None: it can). Only Adam and
    AdamW have the moments it stores (``tpu_train.compile.stored_moments``)."""
    value = StateDtype(state_dtype).value
    if value == StateDtype.param.value or name in ("adam", "adamw"):
        return None
    return (f"optim.state_dtype={value} sets the dtype of Adam/AdamW's moments; optim.name={name} "
            "has none it stores: use optim.name=adamw (or adam), or optim.state_dtype=param")


def _validate_optimizer(optim, sched) -> None:
    for key in ("lr", "eps", "weight_decay", "beta1", "beta2", "momentum"):
        _require(math.isfinite(optim[key]), f"optim.{key} must be a finite number, got {optim[key]}")
    _require(optim.lr > 0, f"optim.lr must be > 0, got {optim.lr}")
    _require(0 <= optim.beta1 < 1 and 0 <= optim.beta2 < 1,
             f"optim.beta1 and optim.beta2 must be in [0, 1), got {optim.beta1} and {optim.beta2}")
    _require(optim.eps > 0, f"optim.eps must be > 0, got {optim.eps}")
    _require(optim.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {optim.weight_decay}")
    _require(optim.momentum >= 0, f"optim.momentum must be >= 0, got {optim.momentum}")
    _require(optim.name in OPTIMIZERS,
             f"optim.name={optim.name!r} is not supported; valid names: {', '.join(OPTIMIZERS)}")
    problem = state_dtype_problem(optim.name, optim.get("state_dtype", "param"))
    _require(problem is None, problem)
    _require(sched.warmup_steps >= 0,
             f"scheduler.warmup_steps must be >= 0, got {sched.warmup_steps}")
    _require(0 <= sched.min_lr_ratio <= 1,
             f"scheduler.min_lr_ratio must be in [0, 1], got {sched.min_lr_ratio}")
    if ScheduleName(sched.name) is ScheduleName.wsd:
        _require(0 < sched.decay_fraction <= 1,
                 f"scheduler.decay_fraction must be in (0, 1], got {sched.decay_fraction}")


def _validate_moe_impl(cfg) -> None:
    from tpu_train.models import MOE_IMPLS

    _require(cfg.model.moe_impl in (None, *MOE_IMPLS),
             f"model.moe_impl must be one of {', '.join(MOE_IMPLS)} or null, got "
             f"{cfg.model.moe_impl!r}")
    # The grouped form has no PyTorch backward (tpu_train.ops.grouped_matmul): eager steps on
    # the tpu device and fully recomputed layers (whose backward PyTorch traces) need dense.
    eager_on_tpu = StepMode(cfg.trainer.mode) is not StepMode.compiled \
        and cfg.trainer.device == "tpu"
    _require(not (cfg.model.moe_impl == "grouped" and eager_on_tpu),
             "model.moe_impl=grouped trains in the compiled step (or on the CPU); use "
             "trainer.mode=compiled or model.moe_impl=dense")
    recomputed = Remat(cfg.trainer.remat) is Remat.full or cfg.trainer.activation_checkpointing
    _require(not (cfg.model.moe_impl == "grouped" and recomputed
                  and StepMode(cfg.trainer.mode) is StepMode.compiled),
             "model.moe_impl=grouped has no PyTorch backward, which trainer.remat=full layers "
             "use; choose trainer.remat=save_dots (or none), or model.moe_impl=dense")


def _validate_model_and_data(cfg) -> None:
    from tpu_train.models import config_names, family_named

    _validate_moe_impl(cfg)
    names = config_names()
    _require(cfg.model.name in names,
             f"model.name={cfg.model.name!r} is not a known model; valid names: {', '.join(names)}")
    _require(not cfg.checkpoint.export_hf or family_named(cfg.model.name).hf is not None,
             f"checkpoint.export_hf=true, but model family {family_named(cfg.model.name).name} "
             "has no Hugging Face format; set checkpoint.export_hf=false")
    for key in ("n_layers", "max_seq_len"):
        value = cfg.model.get(key)
        _require(value is None or value >= 1,
                 f"model.{key} must be >= 1 or null (the architecture's own), got {value}")
    resolve_model_checkpoint(cfg)
    _require(cfg.model.checkpoint is None or cfg.model.get("n_layers") is None,
             f"model.n_layers={cfg.model.get('n_layers')} shortens a model built from random "
             "weights, but model.checkpoint's weights fix its layers; drop one of the two")
    if cfg.model.checkpoint is not None:
        _require(Path(cfg.model.checkpoint).is_dir(),
                 f"model.checkpoint={cfg.model.checkpoint!r} is not a directory; point it at a "
                 "Hugging Face model directory (config.json + *.safetensors), a checkpoint "
                 "step_N or a Hub model ORG/NAME[@revision]")
    data = cfg.data
    _require(data.format in DATA_FORMATS,
             f"data.format={data.format!r} is not a format; valid formats: {', '.join(DATA_FORMATS)}")
    from tpu_train.data.datasets import TEMPLATES

    _require(data.template in TEMPLATES,
             f"data.template={data.template!r} is not a template; valid templates: {', '.join(TEMPLATES)}")
    _require(0 <= data.holdout <= MAX_HOLDOUT,
             f"data.holdout must be in [0, {MAX_HOLDOUT}] (the fraction of data.path held out for "
             f"validation when data.val_path is not set; 0: none), got {data.holdout}")
    _require(data.seq_len is None or data.seq_len >= 2,
             f"data.seq_len must be >= 2 or null (the model's maximum), got {data.seq_len}")
    _require(data.shuffle_buffer >= 0, f"data.shuffle_buffer must be >= 0, got {data.shuffle_buffer}")
    _require(data.prefetch >= 0,
             f"data.prefetch must be >= 0 (0: build each batch between steps; N: keep N batches "
             f"built ahead in a worker process), got {data.prefetch}")
    _require(data.tokenizer is None or Path(data.tokenizer).exists(),
             f"data.tokenizer={data.tokenizer!r} does not exist; give an existing path or null for "
             "the bundled one")


def _validate_seq_len_for_the_model(cfg) -> None:
    from .builders import hf_checkpoint, model_config

    data = cfg.data
    # The architecture of a Hugging Face model.checkpoint (its config.json, read and checked
    # here), else the named preset.
    model_max = model_config(cfg).max_seq_len
    where = ("model.checkpoint's config.json" if hf_checkpoint(cfg) is not None
             else cfg.model.name)
    _require(data.seq_len is None or data.seq_len <= model_max,
             f"data.seq_len={data.seq_len} exceeds the model's max_seq_len={model_max} ({where}); "
             f"lower it, set model.max_seq_len={data.seq_len} to give the model that many "
             "positions, or data.seq_len=null for the model's maximum")


def resolve_model_checkpoint(cfg: DictConfig) -> str | None:
    """Make a ``model.checkpoint`` of the form ``ORG/NAME[@revision]`` that is no local
    directory the Hugging Face Hub snapshot it names (downloaded into the Hub cache unless
    cached and ``HF_HUB_OFFLINE=1``; :mod:`tpu_train.models.hub`); returns the note that says
    so, or None when there was nothing to resolve. A local directory of that name wins."""
    value = cfg.model.checkpoint
    if value is None or Path(value).is_dir():
        return None
    from tpu_train.models.hub import HubError, download, parse_model_id

    model = parse_model_id(str(value))
    if model is None:
        return None  # not a Hub id: validate_config reports the missing directory
    try:
        cfg.model.checkpoint = str(download(model))
    except HubError as exc:
        raise ConfigError(str(exc)) from None
    return f"note: model.checkpoint={model}: the Hugging Face Hub snapshot in {cfg.model.checkpoint}"


def resolve_seq_len(cfg: DictConfig) -> str | None:
    """Fill in ``data.seq_len: null`` (the default of ``data=jsonl``) with the longest sequence
    the model allows, at most :data:`DEFAULT_MAX_SEQ_LEN`; returns the note that says so, or
    None when ``data.seq_len`` was set. Call after :func:`validate_config`."""
    from .builders import model_config
    from .config import DEFAULT_MAX_SEQ_LEN

    if cfg.data.seq_len is not None:
        return None
    model_max = int(model_config(cfg).max_seq_len)
    cfg.data.seq_len = min(model_max, DEFAULT_MAX_SEQ_LEN)
    why = ("the model's maximum positions" if cfg.data.seq_len == model_max else
           f"the model allows {model_max}; longer sequences cost memory quadratically")
    return f"note: data.seq_len=null: {cfg.data.seq_len} tokens ({why}; set data.seq_len to change)"


def _validate_recipe_settings(recipe) -> None:
    lora = recipe.lora
    _require(lora.rank >= 1, f"recipe.lora.rank must be >= 1, got {lora.rank}")
    _require(lora.alpha > 0, f"recipe.lora.alpha must be > 0, got {lora.alpha}")
    _require(0 <= lora.dropout < 1, f"recipe.lora.dropout must be in [0, 1), got {lora.dropout}")
    _require(len(lora.targets) > 0, "recipe.lora.targets must name at least one projection")
    gen = recipe.generate
    _require(gen.max_new_tokens >= 1, f"recipe.generate.max_new_tokens must be >= 1, got {gen.max_new_tokens}")
    _require(gen.temperature >= 0, f"recipe.generate.temperature must be >= 0, got {gen.temperature}")
    _require(0 < gen.top_p <= 1, f"recipe.generate.top_p must be in (0, 1], got {gen.top_p}")
    _require(len(gen.prompts) > 0, "recipe.generate.prompts must hold at least one prompt")
    ev = recipe.eval
    _require(ev.batches >= 1 and ev.exact_match_examples >= 0 and ev.max_new_tokens >= 1,
             "recipe.eval needs batches >= 1, exact_match_examples >= 0 and max_new_tokens >= 1")
