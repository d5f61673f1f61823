"""Whole (unsharded) host copies of a sharded model's state, and loading them back.

Process 0 writes full checkpoints and the Hugging Face export, and validation runs on a host
copy of the model, so the trainer needs every parameter whole on the host whatever the
layout. Each function here is called by every process of the job: gathering a tensor whose
shards live on other processes is a collective.
"""

from __future__ import annotations

import numpy as np
import torch

from .parallelism import Parallelism


def _host_tensor(value: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``value``; tpu tensors spread over several processes are gathered."""
    value = value.detach()
    if value.device.type != "tpu":
        return value.to("cpu", copy=True)
    array = value.jax_value()
    if getattr(array, "is_fully_addressable", True):
        return value.to("cpu", copy=True)
    from jax.experimental import multihost_utils

    host = np.asarray(multihost_utils.process_allgather(array, tiled=True))
    if value.dtype == torch.bfloat16:  # numpy has no bfloat16: through the bits
        return torch.from_numpy(host.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(host.copy()).to(value.dtype)


def full_model_state(model: torch.nn.Module, parallel: Parallelism) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every tensor whole, on the CPU (all processes call it)."""
    if parallel.layout == "per_device":
        from tpu_train.parallel.per_device import full_model_state_dict

        # Every process gets the whole state: each validates on its own host copy.
        return full_model_state_dict(model, rank0_only=False)
    return {key: _host_tensor(value) for key, value in model.state_dict().items()}


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         parallel: Parallelism) -> dict:
    """``optimizer.state_dict()`` with whole tensors (all processes call it)."""
    if parallel.layout == "per_device":
        from tpu_train.parallel.per_device import full_optimizer_state_dict

        return full_optimizer_state_dict(model, optimizer)  # process 0 writes it
    state = optimizer.state_dict()
    state["state"] = {index: {k: _host_tensor(v) if isinstance(v, torch.Tensor) else v
                              for k, v in values.items()}
                      for index, values in state["state"].items()}
    return state


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    parallel: Parallelism, model_state: dict, optimizer_state: dict) -> None:
    """Load whole state dicts into ``model``/``optimizer`` in their current layout."""
    if parallel.layout == "per_device":
        from tpu_train.parallel.per_device import (load_full_model_state_dict,
                                                    load_full_optimizer_state_dict)

        load_full_model_state_dict(model, model_state)
        load_full_optimizer_state_dict(model, optimizer, optimizer_state)
        return
    model.load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's settings without its parameters (the sharded layout's record)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def restore_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint has {len(groups)} optimizer param groups, the "
                         f"optimizer {len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(saved)
