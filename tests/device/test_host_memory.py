"""The CPU client's host memory settings (tpu_train/device/host_memory.py): a buffer the CPU
client frees is reused by the next program instead of being returned to the kernel and
page-faulted in again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tpu_train.device import host_memory

# Runs a jitted program whose 64 MiB output (allocated on the CPU client's threads) dies after
# each call, and reports the median of the minor page faults of each of the last 20 of 30 calls.
# The median, because the heap can still grow once or twice after the first calls (a small block
# left above the freed one): those calls fault the whole 64 MiB in, the steady state does not.
_PROBE = r"""
import json, resource, statistics
import torch, tpu_train, jax, jax.numpy as jnp
from tpu_train.device import host_memory, runtime
device = runtime.jax_device(0)
fill = jax.jit(lambda x: jnp.broadcast_to(x, (16 * 1024 * 1024,)) + 1.0)
x = jax.device_put(jnp.float32(1.0), device)
faults = []
for i in range(30):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fill(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults_per_call": statistics.median(faults[10:]), "all": faults[10:],
                  "applied": host_memory.applied(), "platform": runtime.platform()}))
"""


def _probe(**env) -> dict:
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, TPU_TRAIN_PLATFORM="cpu", **env))
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory._mallopt() is None,
                    reason="glibc's mallopt only")
def test_freed_buffers_are_reused_without_page_faults():
    kept = _probe()
    default = _probe(**{host_memory.ENV: "default"})
    assert kept["applied"] and kept["platform"] == "cpu"
    assert not default["applied"]
    # Kept, the freed block is reused: whatever the host, no call faults its 64 MiB in again.
    assert kept["faults_per_call"] < 1000, kept
    # 64 MiB is 16,384 pages of 4 KiB: with glibc's defaults every call faults them in again
    # (the block is mmap-ed and unmapped). That is the premise of the settings, and it holds
    # where malloc is glibc's with its default tunables (CPU hosts measured here); a host whose
    # allocator already keeps freed blocks (measured on a TPU v5e host: 0 faults a call with
    # the defaults) has nothing for the settings to save, which the assertion above covers.
    if default["faults_per_call"] >= 1000:
        assert default["faults_per_call"] > 8000, default


def test_opt_out(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "default")
    assert not host_memory.wanted() and host_memory.keep_freed_memory() is False
    monkeypatch.setenv(host_memory.ENV, "")
    assert host_memory.wanted()


@pytest.mark.parametrize("requested, evidence, wanted", [
    ("cpu", [], True), (None, [], True),
    ("cpu", ["/dev/accel0"], True),          # the CPU asked for on a TPU host
    (None, ["/dev/accel0"], False),          # a TPU host: libtpu's workers keep glibc's arenas
    ("tpu", [], False), ("cuda", [], False),
])
def test_the_cpu_clients_settings_are_kept_off_accelerator_hosts(requested, evidence, wanted):
    from tpu_train.device import runtime

    assert runtime.cpu_malloc_settings_wanted(requested, evidence) is wanted
