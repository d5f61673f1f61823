"""The building blocks of a training run, in the order :func:`~tpu_train.trainer.run.assemble`
calls them:

    job = start(cfg)                                     # checks, processes, seed, device
    tokenizer = build_tokenizer(cfg)
    data = build_data(job, tokenizer)
    model = build_model(job, tokenizer, adapt=...)       # on the CPU (adapters, int8 base)
    layout = parallelize(job, model)                     # mesh + plan, or FSDP2/TP; on device
    optimizer, scheduler = build_optimizer(...), build_scheduler(...)
    step = layout.build_step(job, model, optimizer, scheduler)

Nothing here writes to the run directory: a bad configuration fails before the run starts.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from tpu_train.compile.cross_entropy import set_chunk_tokens
from tpu_train.ops.matmul import set_matmul_precision

from . import builders
from .config import BaseDtype, MatmulPrecision, ParamDtype, Precision, StepMode
from .errors import ConfigError
from .log_noise import quiet_process_group_noise, quiet_third_party_logs
from .layouts import Layout
from .parallelism import setup_parallelism
from .rng import seed_everything
from .run_dirs import resolve_latest
from .storage_urls import RunPath, is_local, run_path
from .validation import remat_policy, resolve_model_checkpoint, resolve_seq_len, validate_config
from .world import World, requested_world_size, start_processes


@dataclasses.dataclass
class Job:
    """What every block needs to know about this run."""

    cfg: DictConfig
    world: World
    device: torch.device
    run_dir: RunPath
    mode: StepMode
    precision: Precision
    # Lines for train.log found before it exists (e.g. a damaged checkpoint passed over).
    notes: list[str] = dataclasses.field(default_factory=list)
    # time.monotonic() when the job started (the summary's wall time counts from here).
    started: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class Data:
    """The training stream and what validation reads."""

    train: Any
    val_path: Any  # tpu_train.data.sources.DataFiles (paths and column map) or None
    has_val_loss: bool
    exact_match_path: Any  # the same files when their records have prompts, else None


def resolve_run_dir(cfg: DictConfig) -> RunPath:
    """``run.dir`` (a local path, or a URL: :mod:`~tpu_train.trainer.storage_urls`); in a
    Hydra multirun, the job's own ``<run.dir>/<job number>``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    run_dir = run_path(cfg.run.dir)
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        hydra = HydraConfig.get()
        return (Path(hydra.runtime.output_dir) if is_local(run_dir)
                else run_dir / str(hydra.job.num))
    return run_dir


def start(cfg: DictConfig) -> Job:
    """Check the configuration, join the job's processes, seed, and pick the device."""
    quiet_third_party_logs(bool(cfg.logging.verbose))  # before anything starts XLA
    quiet_process_group_noise(requested_world_size(), bool(cfg.logging.verbose))
    latest_note = resolve_latest(cfg)  # run.dir=latest: the directory it names, first
    hub_note = resolve_model_checkpoint(cfg)  # ORG/NAME: the Hub snapshot's directory
    validate_config(cfg)
    seq_len_note = resolve_seq_len(cfg)
    world = start_processes()
    trainer = cfg.trainer
    if trainer.cpu_threads is not None:
        torch.set_num_threads(trainer.cpu_threads)
    # The tpu device's float32 dots only: PyTorch's own CPU matmuls keep their precision (on a
    # CPU with bfloat16 instructions, ``medium`` would change trainer.device=cpu runs).
    set_matmul_precision(MatmulPrecision(trainer.matmul_precision).value)
    set_chunk_tokens(trainer.loss_chunk_tokens)
    seed_everything(trainer.seed)
    # Last: the tpu backend opens on a thread from here on, while the caller reads the
    # tokenizer, the data and the model.
    device = builders.resolve_device(trainer.device)
    return Job(cfg, world, device, resolve_run_dir(cfg), StepMode(trainer.mode),
               Precision(trainer.precision),
               notes=[note for note in (latest_note, hub_note, seq_len_note) if note])


def build_tokenizer(cfg: DictConfig):
    return builders.build_tokenizer(cfg)


def build_data(job: Job, tokenizer, bundled: str = "tasks") -> Data:
    """The endless training loader (every process reads the same global batches; each feeds
    its own rows, see :meth:`Layout.place_batch`) and the validation files.

    ``data.path: null`` trains on the bundled corpus's ``bundled`` file: ``"tasks"`` (the
    synthetic instruction task) or ``"prose"`` (for pretraining). ``data=synthetic_tokens``
    trains on random token ids and validates on nothing.
    """
    cfg = job.cfg
    if builders.synthetic_tokens(cfg):
        return Data(builders.build_random_token_loader(cfg), None, False, None)
    train_path, val_path = builders.data_paths(cfg, bundled, tokenizer)
    job.notes += _data_notes(cfg, train_path, val_path)
    train = builders.build_train_loader(cfg, tokenizer, train_path)
    has_val_loss = builders.build_val_loader(cfg, tokenizer, val_path) is not None
    kind = builders.first_record_kind(val_path)
    return Data(train, val_path, has_val_loss,
                val_path if kind in ("instruction", "chat") else None)


def _data_notes(cfg: DictConfig, train, val) -> list[str]:
    """What the run's log says of its data: the resolved ``data.template=auto`` and the
    held-out split made (or not) when ``data.val_path`` is not set."""
    from .builders import MIN_HOLDOUT_RECORDS

    data, notes = cfg.data, []
    if data.path is None:
        return notes
    if data.template == "auto":
        notes.append(f"data.template=auto: {train.template} (prompt/response records)")
    if val is not None and val.holdout is not None:
        notes.append(f"note: validation: {val.holdout.percent} of data.path's records held out "
                     f"(seeded by file name and line, never trained on); data.val_path=... to "
                     "validate on your own file, data.holdout=0 for none")
    elif data.val_path is None and data.holdout > 0 and cfg.trainer.val_every_n_steps:
        notes.append(f"note: no validation: data.path has too few records to hold out "
                     f"{data.holdout * 100:g}% (at least {MIN_HOLDOUT_RECORDS}, some of them in the "
                     "held-out fraction); set data.val_path to validate on a file of your own")
    return notes


def build_model(job: Job, tokenizer, from_checkpoint: bool = True,
                adapt: Callable[[torch.nn.Module], torch.nn.Module] | None = None
                ) -> torch.nn.Module:
    """The configured model on the CPU (``model.checkpoint`` loaded when set), changed by
    ``adapt`` (the recipe's adapters) and stored as :func:`store_frozen_base` stores it.

    With an int8 base (``model.base_dtype=int8``) ``adapt`` and :func:`store_frozen_base` run
    on the model while it is on the ``meta`` device (``adapt`` must not read weights), and the
    model is then filled a tensor at a time, each frozen linear weight quantized as it is
    drawn or read (:func:`~tpu_train.trainer.builders.build_quantized_model`): the host holds
    the int8 model and one tensor, never the whole model in bfloat16 (16 GB for an 8B)."""
    cfg = job.cfg
    if not int8_base(cfg):
        model = builders.build_model(cfg, tokenizer.vocab_size, allow_checkpoint=from_checkpoint)
        return adapt(model) if adapt is not None else model

    def prepare(model: torch.nn.Module) -> torch.nn.Module:
        return store_frozen_base(cfg, adapt(model) if adapt is not None else model)

    return builders.build_quantized_model(cfg, tokenizer.vocab_size, prepare,
                                          allow_checkpoint=from_checkpoint)


def int8_base(cfg: DictConfig) -> bool:
    return BaseDtype(cfg.model.base_dtype) is BaseDtype.int8


def store_frozen_base(cfg: DictConfig, model: torch.nn.Module) -> torch.nn.Module:
    """``model.base_dtype=int8``: the frozen linear weights of ``model`` (adapted by the
    recipe) in int8 with per-channel scales; the other frozen weights (embeddings, norms) in
    the compute dtype (bfloat16 under ``trainer.precision=bf16``, else float32), the trained
    ones in float32 (``parallelize`` applies ``trainer.param_dtype``). A ConfigError when the
    recipe trains every linear weight."""
    if not int8_base(cfg):
        return model
    from tpu_train.models.lora import quantize_frozen_linears, store_frozen_floats

    if not quantize_frozen_linears(model):
        raise ConfigError(
            f"model.base_dtype=int8 stores frozen weights in int8, but recipe={cfg.recipe.name} "
            "trains every linear weight (full fine-tuning); use recipe=llama_lora, or "
            "model.base_dtype=param")
    model.to(torch.float32)
    if hasattr(model, "reset_rope_tables"):  # built in bfloat16: the tables exact again
        model.reset_rope_tables()
    compute = Precision(cfg.trainer.precision).compute_dtype
    if compute is not None:
        store_frozen_floats(model, compute)
    return model


def describe_source(cfg: DictConfig) -> str:
    return (str(cfg.model.checkpoint) if cfg.model.checkpoint is not None
            else f"random initialization (seed {cfg.trainer.seed})")


def parallelize(job: Job, model: torch.nn.Module) -> Layout:
    """Choose the job's layout and apply it to ``model``: the layers' remat policy
    (``trainer.remat``; here, so that no recipe can leave it out), the weights stored in
    ``trainer.param_dtype``, the model on the device (sharded per device for
    ``trainer.mode=eager`` under a launcher)."""
    from tpu_train.models import family_of
    from tpu_train.parallel.activation_checkpointing import apply_activation_checkpointing

    remat = remat_policy(job.cfg.trainer)
    if remat != "none":
        family = family_of(model)
        apply_activation_checkpointing(model, remat, blocks=family.blocks(model),
                                       qkv_projections=family.qkv_projections)
    if ParamDtype(job.cfg.trainer.param_dtype) is ParamDtype.bf16:
        model.to(torch.bfloat16)
    parallel = setup_parallelism(job.cfg, model, job.world, job.device)
    parallel.place_model(model)
    return parallel


def build_optimizer(model: torch.nn.Module, cfg: DictConfig) -> torch.optim.Optimizer:
    """The optimizer ``optim.name`` names (:func:`tpu_train.trainer.optim.build_optimizer`)."""
    from .optim import build_optimizer as build

    return build(model, cfg.optim)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: DictConfig):
    from .schedules import build_scheduler as build

    return build(optimizer, cfg.scheduler, cfg.trainer.max_steps)
