"""The building blocks a training recipe assembles, in the order it calls them.

    job = start(cfg)                                     # checks, processes, seed, device
    tokenizer = build_tokenizer(cfg)
    data = build_data(job, tokenizer)
    model = build_model(job, tokenizer)                  # on the CPU
    parallel = parallelize(job, model)                   # mesh + plan, or FSDP2/TP; on device
    optimizer, scheduler = build_optimizer(...), build_scheduler(...)
    step = build_train_step(job, parallel, model, optimizer, scheduler)
    start_step = resume(job, parallel, step, model, optimizer, scheduler, data)
    fit(job, parallel, step, model, optimizer, scheduler, data, ...)

Nothing here writes to the run directory: a bad configuration fails before the run starts.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from omegaconf import DictConfig

from tpu_train.ops.matmul import set_matmul_precision

from . import builders
from .checkpoint import (SHARDED_DIR, checkpoint_dirs, checkpoint_layout, latest_intact_checkpoint,
                         read_checkpoint, verify_checkpoint)
from .config import OPTIMIZERS, MatmulPrecision, OnNonFinite, ParamDtype, Precision, StepMode
from .errors import ConfigError
from .log_noise import quiet_process_group_noise, quiet_third_party_logs
from .parallelism import Parallelism, setup_parallelism
from .rng import restore_rng_state, seed_everything
from .schedules import continue_schedule
from .run_dirs import resolve_latest
from .state import load_full_state, restore_hyperparameters
from .step import EagerStep, causal_lm_loss_sum_and_count
from .validation import resolve_seq_len, validate_config
from .world import World, requested_world_size, start_processes


@dataclasses.dataclass
class Job:
    """What every block needs to know about this run."""

    cfg: DictConfig
    world: World
    device: torch.device
    run_dir: Path
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


def resolve_run_dir(cfg: DictConfig) -> Path:
    """``run.dir``; in a Hydra multirun, the job's own ``<run.dir>/<job number>``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.run.dir)


def start(cfg: DictConfig) -> Job:
    """Check the configuration, join the job's processes, seed, and pick the device."""
    quiet_third_party_logs(bool(cfg.logging.verbose))  # before anything starts XLA
    quiet_process_group_noise(requested_world_size(), bool(cfg.logging.verbose))
    latest_note = resolve_latest(cfg)  # run.dir=latest: the directory it names, first
    validate_config(cfg)
    seq_len_note = resolve_seq_len(cfg)
    world = start_processes()
    trainer = cfg.trainer
    device = builders.resolve_device(trainer.device)
    if trainer.cpu_threads is not None:
        torch.set_num_threads(trainer.cpu_threads)
    # The tpu device's float32 dots only: PyTorch's own CPU matmuls keep their precision (on a
    # CPU with bfloat16 instructions, ``medium`` would change trainer.device=cpu runs).
    set_matmul_precision(MatmulPrecision(trainer.matmul_precision).value)
    seed_everything(trainer.seed)
    return Job(cfg, world, device, resolve_run_dir(cfg), StepMode(trainer.mode),
               Precision(trainer.precision),
               notes=[note for note in (latest_note, seq_len_note) if note])


def build_tokenizer(cfg: DictConfig):
    return builders.build_tokenizer(cfg)


def build_data(job: Job, tokenizer, bundled: str = "tasks") -> Data:
    """The endless training loader (every process reads the same global batches; each feeds
    its own rows, see :meth:`Parallelism.place_batch`) and the validation files.

    ``data.path: null`` trains on the bundled corpus's ``bundled`` file: ``"tasks"`` (the
    synthetic instruction task) or ``"prose"`` (for pretraining).
    """
    cfg = job.cfg
    train_path, val_path = builders.data_paths(cfg, bundled)
    train = builders.build_train_loader(cfg, tokenizer, train_path)
    has_val_loss = builders.build_val_loader(cfg, tokenizer, val_path) is not None
    kind = builders.first_record_kind(val_path)
    return Data(train, val_path, has_val_loss,
                val_path if kind in ("instruction", "chat") else None)


def build_model(job: Job, tokenizer, from_checkpoint: bool = True) -> torch.nn.Module:
    """The configured Llama on the CPU (``model.checkpoint`` loaded when set)."""
    return builders.build_model(job.cfg, tokenizer.vocab_size, allow_checkpoint=from_checkpoint)


def describe_source(cfg: DictConfig) -> str:
    return (str(cfg.model.checkpoint) if cfg.model.checkpoint is not None
            else f"random initialization (seed {cfg.trainer.seed})")


def parallelize(job: Job, model: torch.nn.Module) -> Parallelism:
    """Resolve ``parallel.*``, store the weights in ``trainer.param_dtype`` and put the model on
    the device (sharded per device for ``trainer.mode=eager`` under a launcher)."""
    if ParamDtype(job.cfg.trainer.param_dtype) is ParamDtype.bf16:
        model.to(torch.bfloat16)
    parallel = setup_parallelism(job.cfg, model, job.world, job.device)
    if parallel.layout != "per_device":
        model.to(job.device)
    return parallel


def build_optimizer(model: torch.nn.Module, cfg: DictConfig) -> torch.optim.Optimizer:
    """The ``torch.optim`` class ``optim.name`` names, over the trainable parameters (weight
    decay on matrices only), given the ``optim`` fields its constructor takes. The name was
    checked against :data:`OPTIMIZERS` by ``validate_config``."""
    from .optim import build_optimizer as build_adamw, parameter_groups

    optim = cfg.optim
    if optim.name == "adamw":
        return build_adamw(model, optim)
    cls = getattr(torch.optim, OPTIMIZERS[optim.name])
    offered = {"lr": optim.lr, "betas": (optim.beta1, optim.beta2), "eps": optim.eps,
               "momentum": optim.momentum}
    accepted = inspect.signature(cls).parameters
    groups = parameter_groups(model, optim.weight_decay)
    if not groups:
        raise ConfigError("the model has no trainable parameters; nothing to optimize")
    return cls(groups, **{k: v for k, v in offered.items() if k in accepted})


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: DictConfig):
    from .schedules import build_scheduler as build

    return build(optimizer, cfg.scheduler, cfg.trainer.max_steps)


class TrainStep:
    """``step(host micro-batches) -> {"loss", "grad_norm", "lr"}`` in any layout.

    ``compiled`` is the ``CompiledTrainStep`` (None in eager mode); :meth:`place` puts its
    parameters and optimizer state on the mesh (before the first call, after a full resume).
    """

    def __init__(self, parallel: Parallelism, run: Callable, compiled=None,
                 host_batches: bool = False):
        self.parallel = parallel
        self.compiled = compiled
        self._run = run
        # ``run`` takes this process's rows on the host and transfers them itself.
        self._host_batches = host_batches

    def place(self) -> None:
        if self.parallel.layout == "spmd":
            from tpu_train.parallel import place_for_step

            place_for_step(self.compiled)

    def __call__(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> dict:
        return self._run(self.parallel.place_batch(micro_batches,
                                                   to_device=not self._host_batches))


def build_train_step(job: Job, parallel: Parallelism, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer, scheduler,
                     loss_fn=causal_lm_loss_sum_and_count) -> TrainStep:
    """The eager step, or the whole step compiled into one program (on the mesh if any).

    Both check the loss and the gradient norm before updating and apply no update when either
    is not finite (the compiled step inside its program), whatever ``trainer.on_nan``: with
    ``skip`` the loop goes on (and counts the skip), with ``stop`` it stops. So a non-finite
    update never reaches the parameters or a checkpoint.
    """
    trainer = job.cfg.trainer
    assert OnNonFinite(trainer.on_nan) in (OnNonFinite.skip, OnNonFinite.stop)
    if job.mode in (StepMode.eager, StepMode.fused):
        _, size = parallel.data_parallel_rank()
        eager = EagerStep(model, optimizer, scheduler, job.device, job.precision,
                          trainer.max_grad_norm, skip_non_finite=True, data_parallel_size=size,
                          tensor_parallel_size=parallel.shape.tensor if parallel.sharded else 1)
        return TrainStep(parallel, eager if job.mode is StepMode.eager else _fused(eager))
    from tpu_train.compile import compile_train_step

    # bf16: the forward and backward run on bf16 copies of the float32 parameters, so the
    # activations and the residual stream stay bf16 (compile_train_step's compute_dtype).
    compute = torch.bfloat16 if job.precision is Precision.bf16 else None
    compiled = compile_train_step(
        model, optimizer, loss_fn, scheduler=scheduler, max_grad_norm=trainer.max_grad_norm,
        grad_accum_steps=trainer.grad_accum_steps, mesh=parallel.mesh, plan=parallel.plan,
        compute_dtype=compute, skip_non_finite=True, scan_layers=trainer.scan_layers)
    if parallel.layout == "spmd":
        return TrainStep(parallel, compiled, compiled)

    def run(micro_batches):
        # The compiled step accumulates internally: hand it the micro-batches joined, on the
        # host, where joining costs no device program; the step's executable transfers them
        # with its other arguments.
        if len(micro_batches) == 1:
            return compiled(micro_batches[0])
        return compiled({k: torch.cat([b[k] for b in micro_batches]) for k in micro_batches[0]})

    return TrainStep(parallel, run, compiled, host_batches=True)


def _fused(step: Callable) -> Callable:
    """``step`` in fused eager mode: its ops are recorded and run as regions, each when the
    step reads a value (the finiteness check, the loss) or at the step's end."""
    from tpu_train.device.lazy import eager_mode

    def run(micro_batches):
        with eager_mode("fused"):
            return step(micro_batches)

    return run


def checkpoint_to_resume(job: Job) -> Path | None:
    """The newest intact checkpoint of ``run.dir``, or ``checkpoint.load_step``'s; None to start.

    Every candidate is verified against the SHA-256 sums in its ``meta.json``
    (:func:`~tpu_train.trainer.checkpoint.verify_checkpoint`; checkpoints written before the
    sums existed load unverified). A damaged newest checkpoint is never used: a warning names
    it, what is wrong and the older intact one resumed instead (recorded in ``job.notes`` for
    ``train.log`` too). A damaged ``checkpoint.load_step``, or no intact checkpoint at all, is
    a :class:`ConfigError`.
    """
    options = job.cfg.checkpoint
    found = dict(checkpoint_dirs(job.run_dir))
    if found and not options.resume:
        raise ConfigError(
            f"run.dir={str(job.run_dir)!r} holds checkpoints (newest {found[max(found)].name}) "
            "and checkpoint.resume=false; choose a new run.dir to start fresh")
    if options.load_step is not None:
        if options.load_step not in found:
            raise ConfigError(
                f"checkpoint.load_step={options.load_step}: run.dir={str(job.run_dir)!r} has no "
                f"checkpoint of that step; it has steps {sorted(found) or 'none'}")
        chosen = found[options.load_step]
        problem = verify_checkpoint(chosen)
        if problem is not None:
            raise ConfigError(f"checkpoint.load_step={options.load_step}: {chosen} is damaged "
                              f"({problem}); choose another step or delete it")
        return chosen
    if not found:
        return None
    chosen, damaged = latest_intact_checkpoint(job.run_dir)
    if chosen is None:
        raise ConfigError(
            f"run.dir={str(job.run_dir)!r}: every checkpoint is damaged (newest "
            f"{damaged[0][0].name}: {damaged[0][1]}); choose a new run.dir to start fresh")
    for path, problem in damaged:
        note = (f"warning: checkpoint {path} is damaged ({problem}); resuming from the newest "
                f"intact one, {chosen}")
        job.notes.append(note)
        if job.world.is_main:
            print(f"tpu-train: {note}", file=sys.stderr, flush=True)
    return chosen


def resume(job: Job, parallel: Parallelism, step: TrainStep, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer, scheduler, data: Data) -> tuple[int, Path | None]:
    """Load the newest checkpoint of ``run.dir`` if there is one, and place the step.

    Returns (the step to continue from, the checkpoint or None). Either layout restores onto
    any mesh and process count.
    """
    found = checkpoint_to_resume(job)
    if found is None:
        step.place()
        return 0, None
    try:
        model_state, training_state, meta = read_checkpoint(found)
    except Exception as exc:  # noqa: BLE001 - an unverified (older) checkpoint that is damaged
        raise ConfigError(f"cannot read checkpoint {found} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); choose "
                          "another checkpoint.load_step or a new run.dir") from exc
    if model_state is None and step.compiled is None:
        raise ConfigError(
            f"{found} is a sharded checkpoint (written by several processes sharing one mesh); "
            "it resumes with the compiled step, on any mesh or one device: set "
            "trainer.mode=compiled trainer.device=tpu")
    try:
        if model_state is not None:
            load_full_state(model, optimizer, parallel, model_state, training_state["optimizer"])
            step.place()
        else:
            from tpu_train.parallel.sharded_checkpoint import load_sharded

            step.place()
            if parallel.layout != "spmd":  # one device: no placement made the optimizer state
                _create_optimizer_state(step.compiled)
            load_sharded(found / SHARDED_DIR, step.compiled)
            restore_hyperparameters(optimizer, training_state["param_groups"])
        scheduler.load_state_dict(training_state["scheduler"])
        data.train.load_state_dict(training_state["data"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"run.dir={str(job.run_dir)!r} holds a checkpoint of a different configuration "
            f"({checkpoint_layout(found)} layout: {str(exc).splitlines()[0]}); use a new "
            "run.dir or the original settings") from exc
    restore_rng_state(training_state["rng"], job.device)
    _note_kept_settings(job, training_state)
    note = continue_schedule(scheduler, job.cfg.scheduler, job.cfg.trainer.max_steps,
                             int(meta["step"]))
    if note:
        job.notes.append(note)
    return int(meta["step"]), found


def _create_optimizer_state(compiled) -> None:
    """The optimizer state a sharded checkpoint restores into, created as ``torch.optim``
    would at its first step (on a mesh, placing the step creates it)."""
    for group in compiled.optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                compiled.adapter.ensure_state(p, group)


def _note_kept_settings(job: Job, training_state: dict) -> None:
    """A resumed run continues the checkpoint's schedule and optimizer settings exactly (that
    is what makes resuming exact); a different ``optim.lr`` on the command line is therefore
    not applied, and the run says so instead of ignoring it silently."""
    saved = training_state["scheduler"].get("base_lrs") or []
    wanted = float(job.cfg.optim.lr)
    if saved and any(abs(lr - wanted) > 1e-12 * max(abs(lr), abs(wanted)) for lr in saved):
        job.notes.append(
            f"note: optim.lr={wanted:g} differs from the resumed checkpoint's {saved[0]:g}; the "
            "checkpoint's optimizer and schedule settings are kept (resume in a new run.dir "
            "from its hf/ export to change them)")
