"""What a compiled step's first call, a validation's first decoding and placing a model compile
before any training: on a TPU every small program costs ~0.1-1.5 s to compile, on the main
thread, before the first step can start. Counted here with JAX's own compile event."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
import torch

import tpu_train
from tpu_train.compile.functional_optim import adapter_for
from tpu_train.compile.lowering import create_missing_state
from tpu_train.device import lazy, runtime, storage
from tpu_train.device.tensor import storage_of

DEVICE = tpu_train.device(0)
_compiles: dict[int, int] = {}


def _on_event(event: str, _seconds: float, **_) -> None:
    # Counted per thread: an earlier test's ahead-of-time compile may still be running on a
    # thread of its own, and its compile is not this test's.
    if event == "/jax/core/compile/backend_compile_duration":
        ident = threading.get_ident()
        _compiles[ident] = _compiles.get(ident, 0) + 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compiles_so_far() -> int:
    """Programs built on this thread so far: compiled by XLA, or read from the persistent
    cache (JAX's event times both; a TPU session's cache keeps every program)."""
    return _compiles.get(threading.get_ident(), 0)


# Shapes nothing else in the suite uses, so that no program for them is cached yet.
SHAPES = [(37, 11), (11, 37), (5, 7, 3), (41,), (13, 29)]


def fresh_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator) for s in SHAPES]


def test_shape_whole_reshapes_every_storage_with_one_program():
    host = fresh_tensors(0)
    tensors = [t.to(DEVICE) for t in host]
    stores = [storage_of(t) for t in tensors]
    for store, value in zip(stores, host):  # flat, as eager ops leave them on any platform
        store.buffer = jax.device_put(value.numpy().reshape(-1), runtime.jax_device(0))
    before = compiles_so_far()
    storage.shape_whole(stores, [tuple(t.shape) for t in tensors])
    after = compiles_so_far()
    assert after - before == 1  # one program for the five shapes
    shaped = [s.shaped(tuple(t.shape)) for s, t in zip(stores, tensors)]
    assert compiles_so_far() - after == 0  # already shaped: nothing compiled
    for value, expected in zip(shaped, host):
        np.testing.assert_array_equal(np.asarray(value), expected.numpy())
    for tensor, expected in zip(tensors, host):  # and the tensors read as before
        torch.testing.assert_close(tensor.cpu(), expected, rtol=0, atol=0)


def test_missing_optimizer_state_is_created_by_one_program():
    model = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in [(19, 23), (23, 31), (31, 3)])
    model.to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    adapter = adapter_for(optimizer)
    before = compiles_so_far()
    create_missing_state(optimizer, adapter)
    compiled = compiles_so_far() - before
    assert lazy.mode() == lazy.STRICT  # the mode the caller had
    assert 1 <= compiled <= 2, compiled  # the recorded zeros' program (and a scalar's)
    for p in model.parameters():
        state = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].shape == p.shape and state[key].device == p.device
            torch.testing.assert_close(state[key].cpu(), torch.zeros(p.shape), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_first_fill_of_a_size_is_a_copy_from_the_host_where_buffers_are_natural(
        monkeypatch, dtype):
    """Where a platform keeps natural buffers (a TPU), the first fill of a size is a host copy
    (no program to compile); the second compiles the fill's program. On the CPU client every
    fill is its program (compiling it costs milliseconds)."""
    natural = runtime.platform() != "cpu"
    if not natural:
        monkeypatch.setattr(runtime, "natural_buffers", lambda platform_name: True)
    with lazy.strict_recording(False):  # each fill runs when called (a TPU records it)
        _first_and_second_fill(dtype)


def _first_and_second_fill(dtype):
    numel = {torch.float32: 1237, torch.bfloat16: 1239, torch.int32: 1241}[dtype]
    # Another size's fill, twice, with the value the second fill below takes: that value is
    # on the device from then on (device/scalars.py), so nothing but the fill's own program can
    # compile below. (A value placed long ago may be on the device while JAX has evicted the
    # placing program from its caches, after thousands of programs in one process.)
    for _ in range(2):
        torch.full((numel + 1000,), 5, dtype=dtype, device=DEVICE)
    before = compiles_so_far()
    first = torch.full((numel,), 3, dtype=dtype, device=DEVICE)
    middle = compiles_so_far()
    second = torch.full((numel,), 5, dtype=dtype, device=DEVICE)
    after = compiles_so_far()
    assert middle - before == 0  # nothing compiled for the first
    assert after - middle == 1  # the fill's program for the second
    torch.testing.assert_close(first.cpu(), torch.full((numel,), 3, dtype=dtype))
    torch.testing.assert_close(second.cpu(), torch.full((numel,), 5, dtype=dtype))
