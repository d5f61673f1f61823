"""Document masks (packed rows: causal attention within each sample) on the TPU attention
kernels: the segment ids read from the mask, and the kernels run with them, in Pallas'
interpret mode on the CPU client, against PyTorch's SDPA given the same dense mask."""

import jax
import jax.numpy as jnp
import numpy
import pytest
import torch
import torch.nn.functional as F

from tests.ops.lowering_check import to_jax, to_torch
from tests.ops.test_attention import largest, rand, tolerance
from tests.ops.test_attention_tpu import kernel_calls  # noqa: F401  (a fixture)
from tpu_train.ops import attention, attention_tpu

S = 256  # two 128-token blocks
LENGTHS = ((40, 100, 116), (256,))  # per batch row: samples packed one after the other


def _segments(lengths_per_row=LENGTHS):
    return torch.stack([torch.repeat_interleave(torch.arange(1, len(lengths) + 1),
                                                torch.tensor(lengths))
                        for lengths in lengths_per_row])


def _document_mask(segments):
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]


def test_segment_ids_are_read_from_a_document_mask_and_other_masks_are_refused():
    segments = _segments()
    ids, is_document = attention_tpu.document_segments(to_jax(_document_mask(segments)), 2)
    assert bool(is_document)
    numpy.testing.assert_array_equal(numpy.asarray(ids), segments.numpy())
    causal = torch.ones(1, 1, S, S, dtype=torch.bool).tril()
    ids, is_document = attention_tpu.document_segments(to_jax(causal), 3)  # broadcast rows
    assert bool(is_document) and numpy.asarray(ids).max() == 1 and ids.shape == (3, S)
    window = causal & ~torch.ones(S, S, dtype=torch.bool).tril(-8)  # sliding window of 8
    assert not bool(attention_tpu.document_segments(to_jax(window), 1)[1])
    # Same segments, but a query that also sees a later key of its segment: not causal.
    leaky = _document_mask(segments).clone()
    leaky[0, 0, 50, 60] = True
    assert not bool(attention_tpu.document_segments(to_jax(leaky), 2)[1])


def test_the_rule_takes_a_boolean_mask_shared_by_the_heads():
    q, k, v = (jnp.zeros((2, 4, 1024, 64), jnp.bfloat16), jnp.zeros((2, 2, 1024, 64), jnp.bfloat16),
               jnp.zeros((2, 2, 1024, 64), jnp.bfloat16))
    assert attention_tpu.supported(q, k, v, jnp.ones((2, 1, 1024, 1024), jnp.bool_), False)
    assert attention_tpu.supported(q, k, v, jnp.ones((1, 1, 1024, 1024), jnp.bool_), False)
    assert not attention_tpu.supported(q, k, v, jnp.ones((2, 4, 1024, 1024), jnp.bool_), False)
    assert not attention_tpu.supported(q, k, v, jnp.zeros((2, 1, 1024, 1024)), False)  # a bias
    assert not attention_tpu.supported(q, k, v, jnp.ones((1024, 1024), jnp.bool_), False)


def _reference(q, k, v, mask, grad):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, attn_mask=mask,
                                              enable_gqa=k.shape[1] != q.shape[1])
    expected.backward(grad)
    return expected.detach(), [leaf.grad for leaf in leaves]


def _fused(q, k, v, mask, grad):
    out, lse, *_, seed, offset, _ = attention.scaled_dot_product_fused_attention(
        to_jax(q), to_jax(k), to_jax(v), to_jax(mask), 0.0, False, False)
    grads = attention.scaled_dot_product_fused_attention_backward(
        to_jax(grad), to_jax(q), to_jax(k), to_jax(v), to_jax(mask), [True, True, True, False],
        out, lse, None, None, S, S, 0.0, False, seed, offset)
    return out, grads


@pytest.mark.parametrize("dtype", [torch.bfloat16])  # the dtype the kernels run on a TPU
def test_a_document_mask_on_the_kernels_matches_torch(dtype, kernel_calls):
    """Forward and backward ops: the kernels with the mask's segment ids give PyTorch's dense
    masked attention; without the segments (the causal kernel alone) they would not."""
    q, k, v = rand(2, 4, S, 64, dtype=dtype), rand(2, 2, S, 64, dtype=dtype, seed=1), \
        rand(2, 2, S, 64, dtype=dtype, seed=2)
    grad = rand(2, 4, S, 64, dtype=dtype, seed=5)
    mask = _document_mask(_segments())
    expected, expected_grads = _reference(q, k, v, mask, grad)
    with attention_tpu.interpreted():
        out, grads = _fused(q, k, v, mask, grad)
        causal_only, _ = attention_tpu.forward(to_jax(q), to_jax(k), to_jax(v), True, None)
    assert kernel_calls == {"forward": 2, "backward": 1}
    torch.testing.assert_close(to_torch(out, dtype), expected,
                               **tolerance(dtype, S, 3, 3, largest(expected)))
    for got, want in zip(grads[:3], expected_grads):
        torch.testing.assert_close(to_torch(got, dtype), want,
                                   **tolerance(dtype, S, 6, 6, largest(want)))
    assert (to_torch(causal_only, dtype) - expected).abs().max() > 0.1


def test_any_other_boolean_mask_takes_the_xla_form_and_matches_torch():
    """A sliding-window mask is no document mask: the program runs the XLA form (the lax.cond's
    other branch) and still gives PyTorch's numbers."""
    dtype = torch.float32
    q, k, v = rand(1, 2, S, 64, dtype=dtype), rand(1, 2, S, 64, dtype=dtype, seed=1), \
        rand(1, 2, S, 64, dtype=dtype, seed=2)
    grad = rand(1, 2, S, 64, dtype=dtype, seed=5)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    mask = (causal & ~torch.ones(S, S, dtype=torch.bool).tril(-8))[None, None]
    expected, expected_grads = _reference(q, k, v, mask, grad)
    with attention_tpu.interpreted():
        out, grads = _fused(q, k, v, mask, grad)
    torch.testing.assert_close(to_torch(out, dtype), expected,
                               **tolerance(dtype, S, 3, 3, largest(expected)))
    for got, want in zip(grads[:3], expected_grads):
        torch.testing.assert_close(to_torch(got, dtype), want,
                                   **tolerance(dtype, S, 6, 6, largest(want)))


def test_jax_derivative_with_a_document_mask_runs_the_backward_kernels(kernel_calls):
    dtype = torch.float32
    q, k, v = rand(2, 4, S, 64, dtype=dtype), rand(2, 2, S, 64, dtype=dtype, seed=1), \
        rand(2, 2, S, 64, dtype=dtype, seed=2)
    grad = rand(2, 4, S, 64, dtype=dtype, seed=5)
    mask = _document_mask(_segments())
    expected, expected_grads = _reference(q, k, v, mask, grad)

    def loss(q_, k_, v_):
        out = attention.scaled_dot_product_fused_attention(q_, k_, v_, to_jax(mask), 0.0, False,
                                                           False)[0]
        return jnp.sum(out * to_jax(grad)), out

    with attention_tpu.interpreted():
        grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(
            to_jax(q), to_jax(k), to_jax(v))
    assert kernel_calls == {"forward": 1, "backward": 1}
    torch.testing.assert_close(to_torch(out, dtype), expected,
                               **tolerance(dtype, S, 3, 3, largest(expected)))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(to_torch(got, dtype), want,
                                   **tolerance(dtype, S, 6, 6, largest(want)))


WINDOW = 100  # not a multiple of the 128-token blocks: partly masked blocks on both edges


def _window_mask(segments, window=WINDOW):
    band = ~torch.ones(S, S, dtype=torch.bool).tril(-window)
    return _document_mask(segments) & band


def test_under_a_sliding_window_the_check_takes_the_window():
    segments = _segments()
    mask = to_jax(_window_mask(segments))
    assert not bool(attention_tpu.document_segments(mask, 2)[1])
    ids, is_document = attention_tpu.document_segments(mask, 2, WINDOW)
    assert bool(is_document)
    numpy.testing.assert_array_equal(numpy.asarray(ids), segments.numpy())
    # A plain document mask is no sliding-window one where a segment is longer than it.
    assert not bool(attention_tpu.document_segments(to_jax(_document_mask(segments)), 2,
                                                    WINDOW)[1])
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        with attention_tpu.sliding_window(0):
            pass


@pytest.mark.parametrize("packed", [False, True], ids=["one_sample", "packed"])
def test_a_sliding_window_mask_on_the_local_kernels_matches_torch(packed, kernel_calls,
                                                                  monkeypatch):
    """Under attention_tpu.sliding_window the kernels run with the splash library's LocalMask
    (and the segment ids of packed rows), forward and backward, and give PyTorch's dense
    masked attention; the causal kernels alone would not."""
    dtype = torch.bfloat16
    q, k, v = rand(2, 4, S, 64, dtype=dtype), rand(2, 2, S, 64, dtype=dtype, seed=1), \
        rand(2, 2, S, 64, dtype=dtype, seed=2)
    grad = rand(2, 4, S, 64, dtype=dtype, seed=5)
    segments = _segments() if packed else _segments(((S,), (S,)))
    mask = _window_mask(segments)
    if not packed:
        mask = mask[:1]  # one [1, 1, S, S] mask for every row, as the model passes it
    expected, expected_grads = _reference(q, k, v, mask, grad)
    built = []
    make_kernel = attention_tpu._kernel
    monkeypatch.setattr(attention_tpu, "_kernel",
                        lambda *args: built.append(args) or make_kernel(*args))
    with attention_tpu.interpreted(), attention_tpu.sliding_window(WINDOW):
        out, grads = _fused(q, k, v, mask, grad)
    assert kernel_calls == {"forward": 1, "backward": 1}
    # (sequence, group, is_causal, interpret, window): the local kernels, both directions.
    assert built == [(S, 2, True, True, WINDOW)] * 2
    torch.testing.assert_close(to_torch(out, dtype), expected,
                               **tolerance(dtype, S, 3, 3, largest(expected)))
    for got, want in zip(grads[:3], expected_grads):
        torch.testing.assert_close(to_torch(got, dtype), want,
                                   **tolerance(dtype, S, 6, 6, largest(want)))
    causal, _ = _reference(q, k, v, _document_mask(segments), grad)
    assert (causal - expected).abs().max() > 0.1

