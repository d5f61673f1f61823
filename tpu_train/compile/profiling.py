"""Profile training steps: PyTorch's host-side trace and the XLA device trace, together.

A tpu op or compiled step shows up twice: PyTorch's profiler sees the Python and dispatcher
work on the host (``torch.profiler``), while the device work — XLA executables, their
fusions, transfers — is only visible to the PJRT profiler JAX drives
(``jax.profiler.trace``). :func:`profile` runs both over the same region and puts both
traces in one TensorBoard run folder::

    from tpu_train.compile.profiling import annotate, profile

    with profile("runs/prof"):
        for batch in batches:
            with annotate("train_step"):
                metrics = step(batch)

    tensorboard --logdir runs/prof        # Profile tab (pip install tensorboard-plugin-profile)

Files written under ``logdir/plugins/profile/<run>/``:

* ``<host>.xplane.pb`` — the XLA/PJRT trace (TensorBoard's profile plugin; device ops,
  step markers, HLO op statistics);
* ``perfetto_trace.json.gz`` and ``<host>.trace.json.gz`` — the same trace for
  https://ui.perfetto.dev and ``chrome://tracing``;
* ``<host>.pt.trace.json.gz`` — PyTorch's host trace (Chrome trace format: Perfetto and
  ``chrome://tracing`` open it).

:func:`annotate` marks a region in both traces under one name, so a step can be found in
either.
"""

from __future__ import annotations

import contextlib
import glob
import os
import socket

import jax
import torch

from tpu_train.device import runtime

__all__ = ["annotate", "profile"]


@contextlib.contextmanager
def annotate(name: str):
    """Name a region in both the PyTorch and the JAX/XLA trace."""
    with torch.profiler.record_function(name), jax.profiler.TraceAnnotation(name):
        yield


def _run_dirs(logdir: str) -> set:
    return set(glob.glob(os.path.join(logdir, "plugins", "profile", "*")))


@contextlib.contextmanager
def profile(logdir: str, *, record_shapes: bool = False, with_stack: bool = False,
            perfetto: bool = True):
    """Trace the enclosed code with ``torch.profiler`` and ``jax.profiler`` into ``logdir``.

    Yields the ``torch.profiler.profile`` object (``key_averages()`` etc. work after the
    block). On exit the device is synchronized first, so work queued inside the block is in
    the device trace instead of being cut off by the asynchronous dispatch.

    Args:
        logdir: TensorBoard log directory (created if missing).
        record_shapes, with_stack: passed to ``torch.profiler.profile``.
        perfetto: also write the JAX trace as ``perfetto_trace.json.gz``.
    """
    os.makedirs(logdir, exist_ok=True)
    before = _run_dirs(logdir)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  record_shapes=record_shapes, with_stack=with_stack)
    with jax.profiler.trace(logdir, create_perfetto_trace=perfetto):
        with prof:
            try:
                yield prof
            finally:
                # Inside both traces: wait for the work the block queued (PJRT runs it
                # asynchronously) so its device events are recorded. A block that used no
                # device leaves the backend unopened.
                if runtime.devices_enumerated():
                    for index in range(torch.tpu.device_count()):
                        torch.tpu.synchronize(index)
    # jax.profiler made a fresh run folder; PyTorch's trace goes next to its files.
    new = sorted(_run_dirs(logdir) - before)
    run_dir = new[-1] if new else os.path.join(logdir, "plugins", "profile", "torch")
    os.makedirs(run_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(run_dir, f"{socket.gethostname()}.pt.trace.json.gz"))
