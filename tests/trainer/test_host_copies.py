"""``tpu_train.trainer.state.host_tensor``: the trainer's host copies (checkpoints, the
Hugging Face export, validation on the host) leave the device tensors as they were."""

from __future__ import annotations

import torch

import tpu_train
from tpu_train.device import storage_of
from tpu_train.trainer.state import host_tensor

DEVICE = tpu_train.device(0)


def test_a_host_copy_runs_nothing_on_the_device_and_keeps_the_buffer():
    """A whole tensor's copy is its buffer fetched and reshaped on the host: the storage keeps
    the very buffer it had (reading the tensor's value on the device first would give a
    flat storage its tensor's shape: a program to compile and a copy, then another back)."""
    source = torch.randn(6, 5)
    weight = source.to(DEVICE)
    before = storage_of(weight).lazy_buffer
    copy = host_tensor(weight)
    assert copy.device.type == "cpu" and torch.equal(copy, source)
    assert storage_of(weight).lazy_buffer is before
    # A view: its own elements, the storage untouched too.
    assert torch.equal(host_tensor(weight[1:3, ::2]), source[1:3, ::2])
    bf16 = source.to(torch.bfloat16)
    assert torch.equal(host_tensor(bf16.to(DEVICE)), bf16)
