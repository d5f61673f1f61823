"""How ``tpu-train`` starts: its configuration first, then torch, JAX and the backend.

``import tpu_train`` in the command's own process (:func:`command_arguments`) imports neither
torch nor JAX: the command composes its configuration and checks it (the schema, then
``tpu_train.trainer.validation``), so that ``--help``, a misspelt key or a bad value is answered
in a fraction of a second; only then does it import the rest (:func:`load_runtime`, the same
:mod:`tpu_train.api` every other ``import tpu_train`` imports at once).

Opening a TPU chip (libtpu's PJRT client, behind JAX's first ``jax.devices()``) takes about
10 s on a v5e host, and the imports of a run (torch, JAX, the trainer's modules) several
seconds before the recipe's own code runs. A training command therefore opens the backend on a
thread (:func:`tpu_train.device.runtime.open_in_background`, the same choice of platform as at
first device use) before it imports torch; the imports, the tokenizer and the data go on
meanwhile, and the first use of the device waits for the thread. JAX creates the PJRT client
with Python's lock released, so the imports do run meanwhile (libtpu's load before it holds
the lock well under 0.1 s at a time: docs/benchmarks.md, "Opening the backend while
importing").

Only where that is safe and of use (:func:`opens_a_device_early`):

* the process is ``tpu-train`` or ``python -m tpu_train.cli`` (:func:`command_arguments`),
  running a recipe: not ``plan`` (it compiles for virtual CPU devices), no Hydra flag
  (``--help``, ``--cfg``, ``-m``, ...), no ``trainer.device`` other than ``tpu``;
* one process: under a launcher (``WORLD_SIZE`` > 1) ``jax.distributed`` must start before any
  backend does;
* an error of the environment's settings (``TPU_TRAIN_PLATFORM``, the cache directory) opens
  nothing: the first device use raises it, as one line, as without this module.

An error found while the backend is still opening (a recipe's own check, the data) ends the
process at once (:func:`exit_promptly`), not after the seconds a chip takes to open.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, NoReturn

# ``tpu-train plan ...``: the planner, no device (also ``recipe=plan``).
PLAN_COMMAND = "plan"
# torch's launch environment: how many processes a launcher started (1 when unset).
WORLD_SIZE_ENV = "WORLD_SIZE"

# Whether this process opened its backend early (then it is the command line's own process,
# which may end without waiting for the backend).
_opened_early = False


def command_arguments(argv: list[str] | None = None,
                      orig_argv: list[str] | None = None) -> list[str] | None:
    """The arguments of ``tpu-train`` when this process is that command (the console script,
    or ``python -m tpu_train.cli``, also under a launcher), else None (a user's script or
    another tool importing tpu_train).

    While ``python -m`` imports the package, ``sys.argv[0]`` is ``"-m"``: the module is read
    from ``sys.orig_argv``, the arguments from ``sys.argv[1:]`` either way."""
    argv = sys.argv if argv is None else argv
    orig = list(getattr(sys, "orig_argv", argv)) if orig_argv is None else orig_argv
    command = bool(argv) and os.path.basename(argv[0]) == "tpu-train"
    command = command or any(flag == "-m" and module == "tpu_train.cli"
                             for flag, module in zip(orig, orig[1:]))
    return list(argv[1:]) if command else None


def opens_a_device_early(args: list[str], environ: Mapping[str, str] = os.environ) -> bool:
    """Should ``tpu-train args`` open the backend while it imports (see the module's doc)?

    ``False`` unless every argument is a ``KEY=VALUE`` override of a single-process run of a
    recipe whose ``trainer.device``, if given, is ``tpu``: anything else (a Hydra flag, the
    planner, a malformed override, a launcher's ``WORLD_SIZE``) takes the ordinary path."""
    if environ.get(WORLD_SIZE_ENV, "1").strip() != "1":
        return False
    if args and args[0] == PLAN_COMMAND:
        return False
    for arg in args:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+")
        if arg.startswith(("-", "~")) or not sep or not key.strip():
            return False
        if ((key == "recipe" and value == PLAN_COMMAND) or key.startswith("hydra")
                or (key == "trainer.device" and value.strip().lower() != "tpu")):
            return False
    return True


def open_backend_early() -> None:
    """Start opening the backend on a thread when this process is a training command
    (:func:`opens_a_device_early`); otherwise do nothing."""
    global _opened_early
    args = command_arguments()
    if args is None or not opens_a_device_early(args):
        return
    from tpu_train.device import runtime

    try:
        runtime.open_in_background()
    except Exception:  # noqa: BLE001 - the environment's error: the first device use raises it
        return
    _opened_early = True


def load_runtime() -> None:
    """The rest of ``import tpu_train`` in the command's own process, which defers it until its
    configuration is valid (``tpu_train/__init__.py``): open the backend early where that is of
    use (:func:`open_backend_early`), import torch and JAX, register the ``tpu`` device
    (:mod:`tpu_train.api`) and give the package its functions. Any other process did all this
    when it imported tpu_train; calling it again does nothing more."""
    import tpu_train
    from tpu_train import api

    for name in api.__all__:
        # Assigned even where the name is there: ``tpu_train.device`` is the subpackage until
        # the function takes its place (importing tpu_train.device.* sets it).
        setattr(tpu_train, name, getattr(api, name))


def opened_early() -> bool:
    """Did this process start opening its backend early (:func:`open_backend_early`)?"""
    return _opened_early


def exit_promptly(status: int, last_line: str) -> NoReturn:
    """Print ``last_line`` to stderr and ``sys.exit(status)``; in the command's own process
    while the backend it opened early is still opening, an immediate exit instead
    (:func:`runtime.exit_without_waiting`)."""
    if _opened_early:
        from tpu_train.device import runtime

        if runtime.opening():
            runtime.exit_without_waiting(status, last_line)
    print(last_line, file=sys.stderr)
    sys.exit(status)
