"""Seeding and capture/restore of every random number generator a training step may consume."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's default generators (all devices torch knows)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _device_module(device: torch.device):
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "get_rng_state"):
        return None
    return module


def capture_rng_state(device: torch.device) -> dict:
    """RNG states as tensors, lists and ints only, so ``torch.load(weights_only=True)`` reads them."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss),
                  float(cached)],
        "torch": torch.get_rng_state(),
    }
    module = _device_module(device)
    if module is not None:
        state["device"] = module.get_rng_state().cpu()
    return state


def restore_rng_state(state: dict, device: torch.device) -> None:
    """Inverse of :func:`capture_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    module = _device_module(device)
    if module is not None and "device" in state:
        module.set_rng_state(state["device"])
