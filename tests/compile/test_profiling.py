"""``tpu_train.compile.profiling.profile``: a compiled step's host and device traces on disk."""

from __future__ import annotations

import glob
import gzip
import json
import os

import torch

from tests.compile.helpers import DEVICE, mlp, mlp_batches, mlp_loss
from tpu_train.compile import compile_train_step
from tpu_train.compile.profiling import annotate, profile


def _events(path):
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def test_profile_writes_host_and_device_traces(tmp_path):
    model = mlp().to(DEVICE)
    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_loss)
    batches = [{k: v.to(DEVICE) for k, v in b.items()} for b in mlp_batches(3)]
    step(batches[0])  # compile outside the profiled region
    logdir = str(tmp_path / "prof")
    with profile(logdir) as prof:
        for batch in batches[1:]:
            with annotate("train_step"):
                metrics = step(batch)
    assert torch.isfinite(metrics["loss"].cpu())
    runs = glob.glob(os.path.join(logdir, "plugins", "profile", "*"))
    assert len(runs) == 1, runs
    files = os.listdir(runs[0])
    # The XLA trace TensorBoard's profile plugin reads, its Perfetto copy, PyTorch's trace.
    xplanes = [f for f in files if f.endswith(".xplane.pb")]
    torch_traces = [f for f in files if f.endswith(".pt.trace.json.gz")]
    assert len(xplanes) == 1 and os.path.getsize(os.path.join(runs[0], xplanes[0])) > 0
    assert "perfetto_trace.json.gz" in files
    assert len(torch_traces) == 1
    # The annotation is in both traces, once per step.
    host = [e for e in _events(os.path.join(runs[0], torch_traces[0]))
            if e.get("name") == "train_step"]
    assert len(host) == 2
    device = [e for e in _events(os.path.join(runs[0], "perfetto_trace.json.gz"))
              if e.get("name") == "train_step"]
    assert len(device) == 2
    # The profiler object is usable after the block.
    assert any(e.key == "train_step" for e in prof.key_averages())
