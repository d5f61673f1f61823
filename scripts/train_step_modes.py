"""What ``scripts/bench_train_step.py --size`` times: the trainer's compiled step and the
hand-written JAX reference (``scripts/jax_llama.py``) of the same model at the same precision,
plus the device facts the report needs (platform, chip, peak FLOP/s, device memory).

* :class:`TrainerMode` builds the step exactly as ``tpu-train`` does for
  ``model=llama_<size> trainer.mode=compiled trainer.precision=...``: the Hydra config is
  composed from the shipped ``configs/`` (the size's model option included) and the trainer's
  own blocks (``tpu_train.trainer.setup.start``,
  ``parallelize``, ``build_optimizer``, ``build_scheduler``, the layout's ``build_step``) are called, so
  the benchmark follows whatever that path does (autocast, skipping non-finite updates, the
  parameter groups, the schedule).
* :class:`ReferenceMode` is :class:`jax_llama.Reference` with the optimizer settings read back
  from that same config.
"""

from __future__ import annotations

import atexit
import copy
import os
import shutil
import tempfile

import numpy as np

import jax_llama
import jax_llama_scan

# The trainer's settings the benchmark pins: AdamW from scratch (configs/optim/adamw.yaml) and
# a constant learning rate (no warmup), so that both sides use the same lr at every step. The
# trainer spreads the batch over every device of the process (parallel.data=-1).
TRAINER_OVERRIDES = ("optim=adamw", "scheduler=constant", "scheduler.warmup_steps=0",
                     "trainer.device=tpu")


def model_option(size_name: str) -> str:
    """The ``configs/model/`` option of a size of ``jax_llama.SIZES``: its shape, batch and
    trainer settings, as ``tpu-train model=...`` gives them (``scripts/bench_cli_sizes.py``)."""
    return f"llama_{size_name}"


def trainer_config(precision: str, model: str = "debug_tiny", mode: str = "compiled",
                   extra: tuple = ()):
    """The composed ``tpu-train`` config for ``model=model trainer.precision=precision
    trainer.mode=mode``: the model option's settings (e.g. its batch, which sizes micro-batches)
    reach the step as they reach a user's run."""
    from hydra import compose, initialize_config_dir

    from tpu_train.cli import CONFIG_DIR
    from tpu_train.trainer.config import register_schema

    register_schema()
    run_dir = tempfile.mkdtemp(prefix="bench_train_step_run_")  # the blocks write nothing here
    atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
    overrides = [f"model={model}", *TRAINER_OVERRIDES, f"trainer.mode={mode}",
                 f"trainer.precision={precision}", f"run.dir={run_dir}", *extra]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def hyper_from(cfg) -> "jax_llama.Hyper":
    """The reference's optimizer settings, read from the trainer's config."""
    optim = cfg.optim
    return jax_llama.Hyper(lr=optim.lr, b1=optim.beta1, b2=optim.beta2, eps=optim.eps,
                           weight_decay=optim.weight_decay,
                           max_grad_norm=cfg.trainer.max_grad_norm)


class _Timed:
    """How a mode's timed step ends (``wait``): ``"loss"`` (default) reads the loss on the host
    (:func:`wait_for_loss`); ``"ready"`` only waits for the step's outputs (``ready``)."""

    wait = "loss"

    def block(self, loss) -> None:
        if self.wait == "ready":
            self.ready(loss)
        else:
            wait_for_loss(loss)


def compile_stages(records) -> dict:
    """Trace, lower and XLA seconds summed over a compiled step's compilation records."""
    if not records:
        return {}
    return {"trace_s": round(sum(r.trace_s for r in records), 3),
            "lower_s": round(sum(r.lower_s for r in records), 3),
            "xla_compile_s": round(sum(r.compile_s for r in records), 3),
            "compilations": len(records)}


class TrainerMode(_Timed):
    """The step as ``tpu-train`` builds it for ``cfg`` (its ``trainer.mode``: compiled, eager or
    fused), on a copy of ``cpu_model``. With ``batches_ahead`` its batches are placed as the
    training loop places them (``TrainStep.put_batch``): the next one by :meth:`put_ahead`
    once a step is dispatched; without, each goes to the step from the host."""

    def __init__(self, cpu_model, cfg, batches_ahead: bool = False):
        from tpu_train.trainer import setup

        job = setup.start(cfg)
        model = copy.deepcopy(cpu_model)
        parallel = setup.parallelize(job, model)
        optimizer = setup.build_optimizer(model, cfg)
        scheduler = setup.build_scheduler(optimizer, cfg)
        self.train_step = parallel.build_step(job, model, optimizer, scheduler)
        self.train_step.place()
        self.batches_ahead = batches_ahead
        self._ahead = None  # (the NumPy batch, as put_ahead placed it)

    @staticmethod
    def _tensors(batch: dict) -> dict:
        import torch

        return {key: torch.from_numpy(np.asarray(value, dtype=np.int64))
                for key, value in batch.items()}

    def step(self, batch: dict):
        if not self.batches_ahead:
            return self.train_step(self._tensors(batch))["loss"]
        if self._ahead is not None and self._ahead[0] is batch:
            placed, self._ahead = self._ahead[1], None
        else:
            placed = self.train_step.put_batch(self._tensors(batch))
        return self.train_step(placed)["loss"]

    def put_ahead(self, batch: dict) -> None:
        """The next step's batch placed now, while this one runs (the loop's order)."""
        if self.batches_ahead:
            self._ahead = (batch, self.train_step.put_batch(self._tensors(batch)))

    @property
    def stages(self) -> dict:
        # Read when the report is made, not in each timed step (the reference keeps none per
        # step either).
        return compile_stages(getattr(self.train_step.compiled, "compilations", []))

    @property
    def compile_s(self) -> float:
        return sum(v for k, v in self.stages.items() if k.endswith("_s"))

    @staticmethod
    def ready(loss) -> None:
        import jax

        from tpu_train.device.tensor import storage_of

        # The loss's buffer: for the compiled step, one output of its one program.
        jax.block_until_ready(storage_of(loss).buffer)


class UserLoopMode(_Timed):
    """A PyTorch user's own loop around the same model, without the trainer: the model moved to
    the device, ``torch.optim.AdamW`` with ``hyper``'s settings, and
    ``compile_train_step(model, optimizer, loss_fn, max_grad_norm=..., **dtype)``. ``dtype`` is
    ``{"autocast_dtype": torch.bfloat16}`` (torch.autocast's meaning: float32 operands stay
    float32) or ``{"compute_dtype": torch.bfloat16}`` (the trainer's bf16). ``placement``:
    ``"to"``: each batch moved by ``.to(device)`` at its step, as a plain PyTorch loop does;
    ``"ahead"``: the next batch placed by ``step.put_batch`` while this step runs, as
    docs/compile.md shows (what the trainer's loop does)."""

    def __init__(self, cpu_model, hyper, loss_fn, placement: str = "to", **dtype):
        import torch

        import tpu_train
        from tpu_train.compile import compile_train_step

        if placement not in ("to", "ahead"):
            raise ValueError(f"placement {placement!r}: 'to' or 'ahead'")
        self.model = copy.deepcopy(cpu_model).to(tpu_train.device(0))
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=hyper.lr,
                                      betas=(hyper.b1, hyper.b2), eps=hyper.eps,
                                      weight_decay=hyper.weight_decay)
        self.step_fn = compile_train_step(self.model, optimizer, loss_fn,
                                          max_grad_norm=hyper.max_grad_norm, **dtype)
        self.device = tpu_train.device(0)
        self.placement = placement
        self._ahead = None  # (the NumPy batch, as put_ahead placed it)

    _tensors = TrainerMode._tensors

    def step(self, batch: dict):
        if self._ahead is not None and self._ahead[0] is batch:
            placed, self._ahead = self._ahead[1], None
        elif self.placement == "ahead":
            placed = self.step_fn.put_batch(self._tensors(batch))
        else:
            placed = {key: value.to(self.device) for key, value in self._tensors(batch).items()}
        return self.step_fn(placed)["loss"]

    def put_ahead(self, batch: dict) -> None:
        if self.placement == "ahead":
            self._ahead = (batch, self.step_fn.put_batch(self._tensors(batch)))

    @property
    def stages(self) -> dict:
        return compile_stages(self.step_fn.compilations)

    compile_s = TrainerMode.compile_s
    ready = TrainerMode.ready


class ReferenceMode(_Timed):
    """:class:`jax_llama.Reference` on the device the compiled step uses: its batch put on the
    device at its call, or with ``batches_ahead`` by :meth:`put_ahead` during the step
    before, as the trainer's loop puts its batches."""

    def __init__(self, cpu_model, size, hyper, precision: str, remat: str | None = None,
                 batches_ahead: bool = False, scan: bool = False):
        from tpu_train.device import runtime

        kind = jax_llama_scan.ScanReference if scan else jax_llama.Reference
        self.reference = kind(cpu_model, size, hyper, runtime.jax_device(0),
                              precision=precision, remat=remat)
        self.batches_ahead = batches_ahead
        self._ahead = None

    def step(self, batch: dict):
        if self.batches_ahead and self._ahead is not None and self._ahead[0] is batch:
            batch, self._ahead = self._ahead[1], None
        return self.reference.step(batch)[0]

    def put_ahead(self, batch: dict) -> None:
        if self.batches_ahead:
            self._ahead = (batch, self.reference.put_batch(batch))

    @property
    def stages(self) -> dict:
        return self.reference.stages

    @property
    def compile_s(self) -> float:
        return self.reference.compile_s

    def ready(self, loss) -> None:
        self.reference.block(loss)


def w1_pair(steps: int) -> tuple[TrainerMode, ReferenceMode, list]:
    """W1 (``bench_train_step.py --size w1``) as the trainer's compiled bf16 step and the JAX
    reference, both from one initialization, and ``steps`` batches for them."""
    import bench_train_step

    from tpu_train.models import Llama

    size = jax_llama.SIZES["w1"]
    cfg = trainer_config("bf16", model=model_option("w1"), mode="compiled")
    cpu_model = Llama(size.config())
    cpu_model.init_weights(seed=0, device="cpu")
    batches = bench_train_step.make_batches(steps, size.vocab_size, batch=size.batch,
                                            seq=size.seq)
    return (TrainerMode(cpu_model, cfg), ReferenceMode(cpu_model, size, hyper_from(cfg), "bf16"),
            batches)


def wait_for_loss(loss) -> None:
    """The end of one timed step, the same on both sides: the step's loss read on the host
    (``float``: a torch tensor of the trainer's step, a ``jax.Array`` of the reference).

    A training step is measured until its loss is on the host, as a training loop needs it
    (to log it, to stop on a non-finite one): ``tpu-train``'s loop reads the loss and the
    gradient norm of every step inside the step time it reports, which is what
    ``scripts/bench_cli_sizes.py`` compares with this benchmark, and the trainer's step
    itself reads its finiteness flag. Each side thus pays one device-to-host round trip per
    step. All outputs of one program are ready together: the loss's arrival also means the
    update is done. (Waiting with ``jax.block_until_ready`` instead would time the reference
    without any read, the trainer's step with its own.)
    """
    float(loss)


# ------------------------------------------------------------------------------ device facts


def device_facts() -> dict:
    """Platform, chip and its peak bf16 FLOP/s (None where the chip is not in the project's
    table, ``tpu_train.trainer.metrics.PEAK_BF16_TFLOPS``: MFU is then unknown)."""
    from tpu_train.device import runtime
    from tpu_train.trainer.metrics import peak_bf16_tflops

    kind = runtime.device_kind(0)
    peak = peak_bf16_tflops(kind) if runtime.platform() != "cpu" else None
    return {"platform": runtime.platform(), "device_kind": kind,
            "device_count": runtime.device_count(), "host_cores": os.cpu_count(),
            "peak_bf16_tflops": peak}


def device_memory() -> dict | None:
    """``memory_stats()`` of device 0 (bytes in use now and at the peak), None where the
    platform keeps none (the CPU client)."""
    from tpu_train.device import runtime

    stats = runtime.jax_device(0).memory_stats()
    if not stats:
        return None
    return {key: stats.get(key) for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def step_flops(size) -> int:
    """Model FLOPs of one step: (6 N_matmul + 12 layers seq dim) per token x tokens."""
    from tpu_train.models.llama.config import flops_per_token

    return flops_per_token(size.config(), size.seq) * size.tokens


def mfu(size, step_s: float, peak_tflops: float | None) -> float | None:
    if peak_tflops is None:
        return None
    return step_flops(size) / step_s / (peak_tflops * 1e12)
