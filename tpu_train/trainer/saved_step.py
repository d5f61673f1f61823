"""A train step compiled ahead of time (docs/compile.md, "A saved train step").

``compile.save_executable=PATH`` added to a job's command compiles its train step for the first
batch, for this process's devices or with ``compile.target=v5e:2x2`` for a TPU topology whose
chips need not be here, writes the executable and its manifest (``PATH.json``) and exits
without training or writing a run directory. ``compile.executable=PATH`` added to the same
command loads it in place of XLA's compile, before anything is written: a job whose program
differs from the saved one (another model, batch, mesh, platform, version) stops with a one-line
error naming the difference.
"""

from __future__ import annotations

from pathlib import Path

from .config import StepMode
from .errors import ConfigError
from .step import join_micro_batches


def check_options(cfg) -> None:
    """Raise :class:`ConfigError` for a ``compile`` section that cannot be followed."""
    options = cfg.compile
    if options.executable is not None and options.save_executable is not None:
        raise ConfigError("compile.executable and compile.save_executable are both set: save "
                          "with one command, then run the job with the other")
    if options.target is not None and options.save_executable is None:
        raise ConfigError(f"compile.target={options.target} names what compile.save_executable "
                          "compiles for; set compile.save_executable=PATH too")
    wanted = options.executable is not None or options.save_executable is not None
    if wanted and StepMode(cfg.trainer.mode) is not StepMode.compiled:
        raise ConfigError("compile.executable and compile.save_executable are the compiled "
                          f"step's; trainer.mode={StepMode(cfg.trainer.mode).value} compiles no step "
                          "(use trainer.mode=compiled)")
    if options.target is not None:
        from tpu_train.compile.targets import TargetError, parse_target

        try:
            parse_target(options.target)
        except TargetError as error:
            raise ConfigError(f"compile.target: {error}") from None
    if options.executable is not None and not Path(options.executable).is_file():
        raise ConfigError(f"compile.executable={options.executable}: no such file; write it "
                          "with the job's command and compile.save_executable=PATH")


def first_global_batch(loader, micro_batches: int) -> dict:
    """The first step's global batch from ``loader``, which is rewound after (the first
    step reads it again, and a checkpoint saved before it the same data position)."""
    position = loader.state_dict()
    try:
        batches = iter(loader)
        return join_micro_batches([next(batches) for _ in range(micro_batches)])
    finally:
        loader.load_state_dict(position)


def _placed_first_batch(run) -> dict:
    batch = first_global_batch(run.data.train, int(run.job.cfg.trainer.grad_accum_steps))
    return run.step_fn.put_batch(batch).tensors


def save(run) -> dict:
    """Compile ``run``'s train step and write it where ``compile.save_executable`` says;
    prints what was written and the option that loads it. Returns the manifest."""
    from tpu_train.compile.saved_executable import CannotSaveError
    from tpu_train.compile.targets import TargetError

    options = run.job.cfg.compile
    if run.job.world.size > 1:
        raise ConfigError("compile.save_executable compiles in one process; run it without a "
                          "launcher (compile.target names the pod's topology)")
    path = Path(options.save_executable).expanduser().resolve()
    try:
        manifest = run.step_fn.compiled.save_executable(path, _placed_first_batch(run),
                                                        target=options.target)
    except (TargetError, CannotSaveError) as error:
        raise ConfigError(f"compile.save_executable: {error}") from None
    s, environment = manifest["seconds"], manifest["environment"]
    where = options.target or f"{environment['devices']} {environment['device kind']} device(s)"
    print(f"compiled the train step for {where} in {sum(s.values()):.1f} s (trace "
          f"{s['trace']:.1f}, lower {s['lower']:.1f}, XLA {s['compile']:.1f}) and wrote {path} "
          f"({manifest['bytes'] / 2**20:.1f} MiB) with its manifest {path}.json; run the job "
          f"with compile.executable={path}", flush=True)
    return manifest


def load(run) -> None:
    """Load ``compile.executable`` as ``run``'s train step for its first batch's shapes
    (:meth:`tpu_train.compile.CompiledTrainStep.load_executable`); a mismatch is a
    :class:`ConfigError` saying what differs."""
    from tpu_train.compile.saved_executable import ExecutableMismatchError

    path = Path(run.job.cfg.compile.executable).expanduser().resolve()
    try:
        run.step_fn.compiled.load_executable(path, _placed_first_batch(run))
    except ExecutableMismatchError as error:
        raise ConfigError(f"compile.executable: {error}; write it again with this job's "
                          "command and compile.save_executable=PATH") from None
