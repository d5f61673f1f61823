"""Per-device random state for eager random ops (dropout, randn, ...).

Each device holds a counter-based state (seed, offset): the key for the n-th random op is
``fold_in(key(seed), n)``, so a seed reproduces a stream exactly and the state is two integers
that ``get_rng_state`` / ``set_rng_state`` can save in a checkpoint.
"""

from __future__ import annotations

import threading

import jax
import torch

from tpu_train.device import runtime

_DEFAULT_SEED = 67280421310721


class _DeviceRng:
    def __init__(self, seed: int):
        self.seed = seed
        self.offset = 0


_lock = threading.Lock()
_states: dict[int, _DeviceRng] = {}
# The seed of a device whose generator is first used after the last manual_seed_all.
_seed_of_new = _DEFAULT_SEED


def _state(index: int) -> _DeviceRng:
    with _lock:
        if index not in _states:
            _states[index] = _DeviceRng(_seed_of_new)
        return _states[index]


def next_key(index: int) -> jax.Array:
    """A fresh PRNG key for one random op on device ``index``."""
    state = _state(index)
    with _lock:
        offset = state.offset
        state.offset += 1
    key = jax.random.fold_in(jax.random.key(state.seed & 0xFFFFFFFF), offset)
    return jax.device_put(key, runtime.jax_device(index))


def manual_seed(seed: int, index: int) -> None:
    state = _state(index)
    with _lock:
        state.seed, state.offset = int(seed), 0


def manual_seed_all(seed: int) -> None:
    """Every device's generator starts from ``seed``, those not used yet included: seeding
    needs no device count, so ``torch.manual_seed`` does not open the backend (which the
    trainer opens on a thread of its own meanwhile)."""
    global _seed_of_new
    with _lock:
        _seed_of_new = int(seed)
        for state in _states.values():
            state.seed, state.offset = int(seed), 0


def initial_seed(index: int) -> int:
    return _state(index).seed


def get_state(index: int) -> torch.Tensor:
    """The state as a CPU uint8 tensor (like ``torch.cuda.get_rng_state``)."""
    state = _state(index)
    values = torch.tensor([state.seed, state.offset], dtype=torch.int64)
    return values.view(torch.uint8).clone()


def set_state(new_state: torch.Tensor, index: int) -> None:
    if new_state.dtype != torch.uint8 or new_state.numel() != 16:
        raise ValueError(
            "a tpu RNG state is a uint8 tensor of 16 bytes as returned by "
            f"torch.tpu.get_rng_state(); got dtype {new_state.dtype}, {new_state.numel()} elements")
    seed, offset = new_state.clone().view(torch.int64).tolist()
    state = _state(index)
    with _lock:
        state.seed, state.offset = seed, offset
