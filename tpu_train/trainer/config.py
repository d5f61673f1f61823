"""Typed configuration schema of ``tpu-train``, registered in Hydra's ConfigStore.

Every section is a dataclass, so Hydra runs in struct mode: a misspelt key or a value of the
wrong type fails at composition time instead of being silently ignored.  ``configs/config.yaml``
lists ``schema`` first in its defaults, which merges these dataclasses under the YAML files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"


class StepMode(Enum):
    """How a training step runs: op by op in PyTorch (``eager``), eager with its ops recorded
    and run as fused regions (``fused``: tpu_train's fused eager mode), or as one compiled
    program."""

    eager = "eager"
    fused = "fused"
    compiled = "compiled"


class Precision(Enum):
    """``bf16`` runs forward and loss under ``torch.autocast`` in bfloat16; weights stay fp32."""

    fp32 = "fp32"
    bf16 = "bf16"

    @property
    def compute_dtype(self):
        """The dtype the forward and backward compute in, or None for the parameters' own."""
        import torch

        return torch.bfloat16 if self is Precision.bf16 else None


class MatmulPrecision(Enum):
    """How float32 matmuls are computed: ``torch.set_float32_matmul_precision``'s levels.
    ``highest``: exact float32 (PyTorch's default); ``high``: three bfloat16 passes on a TPU
    (about float32's accuracy); ``medium``: one bfloat16 pass, a TPU's native rate and JAX's
    default there. The CPU client computes float32 dots exactly at every level."""

    highest = "highest"
    high = "high"
    medium = "medium"


class Remat(Enum):
    """What each decoder layer keeps for its backward; the rest is recomputed there
    (``tpu_train.parallel.activation_checkpointing``, docs/compile.md). ``none``: everything
    (a scanned stack keeps its projections' outputs); ``full``: only the layer's input;
    ``save_dots``: its projections' outputs; ``save_qkv_proj``: its q, k, v projections';
    ``offload``: ``full`` with each layer's input in host memory (scanned layers of the
    compiled step, ``trainer.scan_layers=true``)."""

    none = "none"
    full = "full"
    save_dots = "save_dots"
    save_qkv_proj = "save_qkv_proj"
    offload = "offload"


class ParamDtype(Enum):
    """How weights are stored: fp32 (master weights, the default) or bf16 (half the memory;
    the optimizer then updates bf16 weights, which loses small updates)."""

    fp32 = "fp32"
    bf16 = "bf16"


class BaseDtype(Enum):
    """How a frozen base (the weights a LoRA run does not train) is stored: like the other
    weights (``param``: ``trainer.param_dtype``), or its linear weights in ``int8`` with one
    float32 scale per output channel, dequantized in the matmul (tpu_train.models.lora)."""

    param = "param"
    int8 = "int8"


class StateDtype(Enum):
    """How Adam/AdamW store their two moments (``tpu_train.compile.stored_moments``)."""

    param = "param"
    bf16 = "bf16"
    fp32 = "fp32"


class OnNonFinite(Enum):
    """What a non-finite loss does: stop the run, or drop that update and continue."""

    stop = "stop"
    skip = "skip"


class ScheduleName(Enum):
    """Learning-rate schedule: warmup then cosine decay, or warmup-stable-decay, or constant."""

    warmup_cosine = "warmup_cosine"
    wsd = "wsd"
    constant = "constant"


@dataclass
class ModelConfig:
    """Which model to build (a named config of a registered family), and optionally a Hugging
    Face directory to load weights from."""

    name: str = "debug_tiny"
    # HF directory or step_N checkpoint; parameters only (no optimizer state).  The YAML files
    # may name a bundled one as ${asset:base_model} (tpu_train/assets/base_model).
    checkpoint: Optional[str] = None
    # A mixture-of-experts model's expert computation, dense or grouped (null: the model's
    # own, MixtralConfig.moe_impl; docs/models.md).
    moe_impl: Optional[str] = None
    # Changes to the architecture that model.name (or model.checkpoint's config.json) gives:
    # ``n_layers`` keeps the first N decoder layers of a preset built from random weights (a
    # shorter stack of a real width, for one chip); ``max_seq_len`` the positions the model
    # takes (its RoPE tables), for sequences longer than its own context.
    n_layers: Optional[int] = None
    max_seq_len: Optional[int] = None
    # int8: the frozen linear weights (LoRA's bases, the output head) in int8 with per-channel
    # scales, quantized as the model is built; the rest of the model in trainer.param_dtype.
    # Needs a recipe that freezes them (recipe=llama_lora).
    base_dtype: BaseDtype = BaseDtype.param


class DataSource(Enum):
    """Where training batches come from: ``files`` (``data.path``, or the bundled corpus), or
    ``synthetic_tokens``: uniformly random token ids of the model's vocabulary, seeded by
    ``trainer.seed``, generated on the host at no measurable cost, for measuring training
    throughput without a dataset (``data=synthetic_tokens``; no validation)."""

    files = "files"
    synthetic_tokens = "synthetic_tokens"


@dataclass
class DataConfig:
    """Training (and validation) data; ``path: null`` selects the bundled corpus.

    A path is a file (.jsonl, .txt, .json, .parquet), a directory written by
    ``Dataset.save_to_disk``, or a list of these. The bundled corpus is ``pretrain.jsonl`` for
    ``llama_pretrain`` and the synthetic instruction task (``tasks_train.jsonl``, validated on
    ``tasks_heldout.jsonl``) otherwise.
    """

    source: DataSource = DataSource.files
    # No default: every data option states it (the jsonl option leaves it for the command line).
    # Any: a path or a list of paths (OmegaConf has no str-or-list type); validation checks it.
    path: Any = MISSING
    val_path: Any = None  # None with path None: the bundled held-out task set
    # One positive weight per data.path file: each sample comes from file i with probability
    # weights[i] / sum(weights), every file cycling on its own. null: the files in order.
    weights: Optional[List[float]] = None
    # Our field (text, prompt, response, instruction, input, output, messages) -> the files'
    # column, e.g. {prompt: question, response: answer}; for data.path and data.val_path.
    # Any, not Dict[str, str]: Hydra merges a {..} override into a typed dict, which struct
    # mode rejects (and OmegaConf 2.3 fails merging into a null Optional[Dict]).
    column_map: Any = None
    format: str = "auto"  # auto (per record), text, instruction or chat
    # How a {prompt, response} record is joined: auto (the tokenizer's chat template when it has
    # one, else default), chat, default (### Instruction/### Response headers) or none (as is).
    # data=jsonl: auto. The schema's none and 0 below are what a run_config.yaml written
    # before these settings existed resumes with.
    template: str = "none"
    # data.path without data.val_path: this fraction of its records (a seeded split) is held out
    # and validated on instead of trained on; 0: no validation. data=jsonl: 0.02.
    holdout: float = 0.0
    tokenizer: Optional[str] = None  # tokenizer file/dir; None: the bundled 512-token BPE
    # null: the model's maximum positions, at most DEFAULT_MAX_SEQ_LEN (a note says which).
    seq_len: Optional[int] = None
    batch_size: int = 8
    shuffle_buffer: int = 0  # 0: file order
    mask_prompt: bool = True  # no loss on prompt tokens of instruction/chat records
    # true: samples packed into rows with document masking (each token attends only to its
    # own sample; positions restart per sample). false: rows cut from the stream of samples as
    # one text, attention crossing sample boundaries.
    packing: bool = False
    # Training batches built ahead (read, tokenized, packed) in a worker process while the
    # step runs; 0 builds each between steps. Resuming is exact either way (docs/architecture.md,
    # "Data loading").
    prefetch: int = 2


# The longest sequence ``data.seq_len: null`` picks where the model allows more: longer
# sequences cost memory quadratically in attention, and few instruction records need more.
DEFAULT_MAX_SEQ_LEN = 2048


@dataclass
class OptimConfig:
    """``name`` is a ``torch.optim`` class (:data:`OPTIMIZERS`); each field reaches it only when
    its constructor takes it (``beta1``/``beta2`` as ``betas``, ``momentum`` for sgd/rmsprop).
    Weight decay applies to matrices only (``tpu_train.trainer.optim.parameter_groups``)."""

    name: str = "adamw"
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.0
    # Adam/AdamW moments: "param" (torch's own: in each parameter's dtype), "bf16" (2 bytes
    # each instead of 4; the update still runs in float32) or "fp32" (for bf16 weights).
    state_dtype: StateDtype = StateDtype.param


# optim.name -> torch.optim class name: the optimizers the compiled step is tested with
# (tests/compile/test_any_optimizer.py); LBFGS needs a closure and SparseAdam sparse gradients.
OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "rmsprop": "RMSprop",
              "adagrad": "Adagrad", "adadelta": "Adadelta", "nadam": "NAdam", "radam": "RAdam",
              "adamax": "Adamax", "asgd": "ASGD"}


@dataclass
class SchedulerConfig:
    name: ScheduleName = ScheduleName.warmup_cosine
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # final lr as a fraction of optim.lr
    decay_fraction: float = 0.2  # wsd: share of max_steps spent decaying at the end
    # Resuming with a larger trainer.max_steps: recompute the schedule for it (the lr follows
    # the longer schedule from the resumed step on). false: such a resume is refused, naming
    # the lr the extra steps would train at (the resumed schedule's final one).
    extend: bool = False


@dataclass
class ParallelConfig:
    """Mesh degrees; -1 means "the devices left over" (one axis at most). ``data=-1``, the
    default, yields to an explicit ``fsdp=-1`` or ``tensor=-1`` (data is then 1)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    # Expert parallelism (a mixture-of-experts model, trainer.mode=compiled): the experts and
    # the batch split over this many devices.
    expert: int = 1
    # Devices each sequence is split over (context parallelism, trainer.mode=compiled): the
    # sequence in 2 x context chunks, attention over the gathered keys and values.
    context: int = 1


@dataclass
class CheckpointConfig:
    every_n_steps: int = 50
    keep_last: int = 2
    # Copy to the host on the training thread, then write (files, checksums, fsyncs, rename)
    # on a background thread while training goes on; the next save, a stop and the end of
    # the run wait for it and raise its error.
    async_save: bool = True
    export_hf: bool = True  # write a Hugging Face directory at the end of training
    # Resume from this step's checkpoint instead of the newest; later ones are moved aside to
    # checkpoints/superseded/ (kept, never resumed from).
    load_step: Optional[int] = None
    # false: refuse a run.dir that holds checkpoints (start fresh in a new run.dir instead).
    resume: bool = True


@dataclass
class LoggingConfig:
    every_n_steps: int = 10
    tensorboard: bool = True
    progress_bar: bool = True
    # [first, last] steps to profile (PyTorch host trace + XLA device trace) into the
    # TensorBoard directory's profile plugin; null: no profiling.
    profile_steps: Optional[List[int]] = None
    # true: third-party logging (jax/absl, transformers, datasets, XLA's C++ logs, warnings
    # from those libraries) as they print it; false keeps the run's own lines only.
    verbose: bool = False


@dataclass
class TrainerConfig:
    max_steps: int = 100
    seed: int = 0
    # The whole step as one XLA program on the tpu device (the JAX CPU client where there is no
    # accelerator).  trainer.mode=eager trainer.device=cpu runs plain PyTorch, for debugging;
    # trainer.mode=fused runs the eager step in fused eager mode on the tpu device.
    mode: StepMode = StepMode.compiled
    device: str = "tpu"  # "cpu" or "tpu"
    precision: Precision = Precision.fp32
    param_dtype: ParamDtype = ParamDtype.fp32
    # float32 matmuls on the tpu device (trainer.precision=fp32, and what autocast leaves in
    # float32), at torch.set_float32_matmul_precision's levels. On a TPU, highest costs six
    # bfloat16 passes per dot and a compile several times longer (docs/tpu.md).
    matmul_precision: MatmulPrecision = MatmulPrecision.highest
    grad_accum_steps: int = 1
    # Rows one device runs forward and backward at a time, at most: each data-parallel shard's
    # rows of a step are split into pieces of this size and their gradients accumulated (in the
    # compiled program, a loop). The step's batch and its result do not change; a smaller
    # program does (XLA's TPU compile time grows with the rows one program holds). null: all
    # of a shard's rows at once.
    micro_batch_size: Optional[int] = None
    max_grad_norm: Optional[float] = 1.0  # null disables clipping
    # Tokens per chunk of the loss, which never holds all tokens' float32 logits at once
    # (docs/compile.md, "The loss over chunks of tokens"); null: as many as keep a chunk's
    # float32 logits within 256 MiB (2,097 tokens for a 32,000 vocabulary).
    loss_chunk_tokens: Optional[int] = None
    # What each layer keeps for its backward (Remat above): less memory for recomputation.
    remat: Remat = Remat.none
    # The older switch: true is trainer.remat=full.
    activation_checkpointing: bool = False
    # Compiled steps trace a stack of identical layers once and run it as a loop (lax.scan).
    # null: stacks of 20 layers or more (shallower ones compile faster unrolled); true: every
    # stack; false: none (docs/compile.md).
    scan_layers: Optional[bool] = None
    val_every_n_steps: int = 50  # 0 disables periodic validation
    # Validate the starting model before the first step too (where validation is on), so the
    # summary compares it with the final one; a resumed run reuses the first run's figures.
    val_at_start: bool = True
    val_batches: int = 4
    on_nan: OnNonFinite = OnNonFinite.stop
    # Stop (saving a checkpoint, printing the command that resumes) once this many minutes of
    # training have passed, e.g. before a reservation ends; null: no limit.
    max_minutes: Optional[float] = None
    # PyTorch intra-op threads on the host; null keeps PyTorch's default (one per core).  On a
    # CPU shared with other jobs, threads that wait for each other can make steps many times
    # slower than one thread.
    cpu_threads: Optional[int] = None


@dataclass
class RunConfig:
    # A directory that already holds a checkpoint is resumed; "latest": the newest unfinished
    # run of the recipe under runs/<recipe>/ (trainer.run_dirs).  In a multirun each job gets
    # <dir>/<job number>.  An fsspec URL works too (gs://bucket/runs/x, trainer.storage_urls;
    # URL/latest looks among the runs under URL).
    dir: str = "runs/${recipe.name}/${now:%Y-%m-%d_%H-%M-%S}"


@dataclass
class PlanConfig:
    chip: Optional[str] = None  # target chip for ahead-of-time planning, e.g. "v5e"
    # Slices joined by DCN (a multi-slice job): plan.chip's topology is one slice's, and
    # parallel.data is split across the slices (only gradient reductions cross DCN).
    num_slices: int = 1
    # With XLA's TPU compiler: read its buffer assignment and stop before code generation
    # (tens of seconds instead of minutes; per-chip memory is then a lower bound, a few percent
    # under the compiler's own total: tpu_train.planning). False: the whole executable's.
    fast: bool = True
    # Where the plan's JSON (every figure) is written; null: runs/plan/<time>/plan.json.
    output: Optional[str] = None
    # A step that does not fit: how many of the settings that would fit (by the planner's
    # estimate) to compile in turn until one fits by XLA's figure; 0: estimates only.
    checks: int = 3


@dataclass
class CompileConfig:
    """The compiled train step's executable, written ahead of time or loaded instead of
    compiling it (docs/compile.md, "A saved train step")."""

    # Load the train step from this file (what save_executable wrote) instead of compiling
    # it; its manifest (PATH.json) must match the job, else a one-line error says what differs.
    executable: Optional[str] = None
    # Compile the train step, write it to this file (and PATH.json) and exit without training.
    save_executable: Optional[str] = None
    # With save_executable: compile for this TPU topology (v5e:1x1, v5e:2x2, ...) with XLA's
    # TPU compiler, whether its chips are here or not; null: for this process's devices.
    target: Optional[str] = None


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: List[str] = field(
        default_factory=lambda: ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    )


@dataclass
class GenerateConfig:
    prompts: List[str] = field(default_factory=lambda: ["Hello"])
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0


@dataclass
class EvalConfig:
    batches: int = 8
    exact_match_examples: int = 32
    max_new_tokens: int = 16


@dataclass
class RecipeConfig:
    name: str = "llama_finetune"
    # A recipe script run instead of recipes/<name>.py (``tpu-train recipe=./my_recipe.py``).
    script: Optional[str] = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


@dataclass
class Config:
    """The whole composed configuration of one ``tpu-train`` job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)


SCHEMA_NAME = "schema"
ASSET_RESOLVER = "asset"
SWEEP_DIR_RESOLVER = "sweep_dir"  # configs/config.yaml: hydra.sweep.dir


def asset_path(name: str) -> str:
    """Absolute path of ``tpu_train/assets/<name>`` (the ``${asset:NAME}`` interpolation)."""
    return str(ASSETS_DIR / name)


def register_schema() -> None:
    """Register :class:`Config` as ``schema`` in Hydra's ConfigStore and the ``${asset:NAME}``
    resolver (idempotent)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)
    if not OmegaConf.has_resolver(ASSET_RESOLVER):
        OmegaConf.register_new_resolver(ASSET_RESOLVER, asset_path)
    if not OmegaConf.has_resolver(SWEEP_DIR_RESOLVER):
        from .storage_urls import hydra_sweep_dir

        OmegaConf.register_new_resolver(SWEEP_DIR_RESOLVER, hydra_sweep_dir)
