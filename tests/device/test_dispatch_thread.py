"""Strict mode with its program calls on a dispatch thread (``TPU_TRAIN_DISPATCH_THREAD=1``):
the same numbers as without it, to the last bit, and a failed call reported where its result
is read.

Oracle: the same steps in strict mode without the thread (the CPU-checked path of
tests/device/test_strict_multi_tensor.py), and for the failure the error raised on purpose.
"""

import pytest
import torch

import tpu_train  # noqa: F401
from tpu_train.device import dispatch_thread, lazy, storage_of

TPU = torch.device("tpu", 0)


@pytest.fixture
def thread_on(monkeypatch):
    # The thread issues the calls of ops run when called: strict mode as the CPU client runs
    # it, not as a TPU does by default (every op recorded into regions).
    monkeypatch.setattr(dispatch_thread, "enabled", True)
    with lazy.strict_recording(False):
        yield
    dispatch_thread.drain()  # nothing queued outlives the test's setting


def _train(steps=4):
    """A model with views, in-place ops, a gradient clip and AdamW: every op kind the
    dispatch thread meets (issued calls, calls on the op's thread, a batched region)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 3)).to(TPU)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    x = torch.linspace(-1, 1, 24).reshape(4, 6).to(TPU)
    losses = []
    for _ in range(steps):
        hidden = model(x)
        loss = (hidden.t() @ hidden).diagonal().sum() + hidden[:, 1:].abs().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.detach())
    return [v.cpu() for v in losses], [p.detach().cpu() for p in model.parameters()]


def test_training_steps_match_the_op_path_bitwise(thread_on):
    # A first run compiles every op and its first calls take other paths (in-place ops without
    # donation): its last bits may differ from a warm run's, thread or not. Compare warm runs.
    dispatch_thread.enabled = False
    _train()
    without = _train()
    dispatch_thread.enabled = True
    with_thread = _train()
    for a, b in zip(with_thread[0] + with_thread[1], without[0] + without[1]):
        assert torch.equal(a, b)


def test_cached_ops_are_issued_to_the_thread(thread_on):
    x = torch.arange(12.0).reshape(3, 4).to(TPU)
    (x * 2 + 1).sum()  # each op's first call compiles on the op's thread
    y = x * 2 + 1  # cached: issued
    assert type(storage_of(y)._buffer) is dispatch_thread.Issued
    assert torch.equal(y.cpu(), torch.arange(12.0).reshape(3, 4) * 2 + 1)


def test_a_failed_call_raises_where_its_result_is_read(thread_on):
    def fails(value):
        raise ValueError("the device refused")

    placeholder, = dispatch_thread.issue(fails, [1.0], [((1,), "float32")], "aten.test_op")
    later, = dispatch_thread.issue(lambda v: [v], [placeholder], [((1,), "float32")],
                                   "aten.reader")
    with pytest.raises(RuntimeError, match="tpu op aten.test_op failed on the device: the "
                                           "device refused"):
        dispatch_thread.value(placeholder)
    with pytest.raises(RuntimeError, match="aten.test_op"):  # its readers fail the same way
        dispatch_thread.value(later)
