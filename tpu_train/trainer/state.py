"""Whole (unsharded) host copies of sharded tensors, and optimizer settings without tensors.

Process 0 writes full checkpoints and the Hugging Face export, and validation runs on a host
copy of the model, so the trainer needs every parameter whole on the host whatever the
layout (each layout's ``full_state``, :mod:`tpu_train.trainer.layouts`). Every process of the
job calls :func:`host_tensor`: gathering a tensor whose shards live on other processes is a
collective.
"""

from __future__ import annotations

import numpy as np
import torch

from tpu_train.device import storage_of


def host_tensor(value: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``value``; tpu tensors spread over several processes are gathered."""
    value = value.detach()
    if value.device.type != "tpu":
        return value.to("cpu", copy=True)
    # Asked of the storage's buffer as it is: reading the tensor's value first would reshape
    # a flat buffer to the tensor's shape on the device (a program to compile, and a copy).
    if getattr(storage_of(value).sharding, "is_fully_addressable", True):
        return value.to("cpu", copy=True)
    from jax.experimental import multihost_utils

    host = np.asarray(multihost_utils.process_allgather(value.jax_value(), tiled=True))
    if value.dtype == torch.bfloat16:  # numpy has no bfloat16: through the bits
        return torch.from_numpy(host.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(host.copy()).to(value.dtype)


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's settings without its parameters (the sharded layout's record)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def restore_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint has {len(groups)} optimizer param groups, the "
                         f"optimizer {len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(saved)
