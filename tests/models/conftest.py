"""Shared fixtures for the model tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def single_intra_op_thread():
    """Run each model test with one intra-op thread, restoring the setting afterwards.

    The models here are tiny, so threading gains nothing, while on a machine whose cores are
    busy the thread pool's synchronization made each small matmul about 20x slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
