"""Causal attention over a sequence split across a mesh axis, against plain causal attention
written out in JAX (the oracle), forward and gradients, on the session's 8 CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tpu_train.ops import attention as attention_ops
from tpu_train.ops import attention_tpu, context_attention, context_attention_tpu
from tpu_train.ops.context_attention import zigzag_positions

from tests.tolerances import assert_rel_close, rtol_for


def _oracle(q, k, v):
    """Causal grouped-query attention in natural order, from its definition."""
    b, h, s, d = q.shape
    repeat = h // k.shape[1]
    k, v = jnp.repeat(k, repeat, axis=1), jnp.repeat(v, repeat, axis=1)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(d)
    keep = np.tril(np.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(keep, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", probs, v)


def test_zigzag_pairs_chunks_so_every_shard_sees_as_many_keys():
    positions = zigzag_positions(16, 4)  # 8 chunks of 2
    assert positions.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    visible = [int(np.sum(shard[:, None] >= np.arange(16)[None, :] ))
               for shard in positions.reshape(4, 4)]
    assert len(set(visible)) == 1, visible  # causal (query, key) pairs per shard
    with pytest.raises(ValueError, match="does not split into 2 x 4 equal chunks"):
        zigzag_positions(12, 4)


def _split_matches_causal_attention(context, tensor, s, d, kernels=False):
    """Causal attention split over ``context`` devices (the zig-zag layout) through the
    fused-attention lowering, value and q/k/v gradients against :func:`_oracle`."""
    devices = np.asarray(jax.devices()[:8]).reshape(1, 8 // context // tensor, context, tensor)
    mesh = Mesh(devices, ("data", "fsdp", "context", "tensor"))
    b, h, kv = (1 if kernels else 2), 4, 2  # interpret mode is slow: one row
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (b, n, s, d), jnp.float32)
               for key, n in zip(keys, (h, kv, kv)))
    cotangent = jax.random.normal(keys[3], (b, h, s, d), jnp.float32)
    order = zigzag_positions(s, context)
    spec = NamedSharding(mesh, PartitionSpec(None, "tensor", "context", None))

    def split(q, k, v):
        with context_attention.sequence_split(mesh, s):
            out = attention_ops.scaled_dot_product_fused_attention(q, k, v, is_causal=True)[0]
        return jnp.sum(out * cotangent[:, :, order])

    placed = [jax.device_put(x[:, :, order], spec) for x in (q, k, v)]
    step = jax.jit(jax.value_and_grad(split, argnums=(0, 1, 2)))
    if kernels:  # on any platform, in Pallas' interpret mode
        with attention_tpu.interpreted():
            program = str(jax.make_jaxpr(step)(*placed))
            value, grads = step(*placed)
        # The forward, dQ and dK/dV kernels, one call each (batched over rows and kv heads).
        assert program.count("pallas_call") == 3, program.count("pallas_call")
    else:
        value, grads = step(*placed)
    expected, expected_grads = jax.value_and_grad(
        lambda q, k, v: jnp.sum(_oracle(q, k, v) * cotangent), argnums=(0, 1, 2))(q, k, v)
    # Forward and backward: three chained reductions over the s keys (scores, softmax, P V).
    rtol = rtol_for(torch.float32, reduction=s, depth=3, functions=("exp",))
    assert abs(float(value) - float(expected)) <= rtol * abs(float(expected))
    for name, got, want in zip("qkv", grads, expected_grads):
        assert_rel_close(torch.from_numpy(np.array(got)),
                         torch.from_numpy(np.array(want)[:, :, order]), rtol, f"d{name}")


@pytest.mark.devices(8)
@pytest.mark.parametrize("context, tensor", [(4, 2), (8, 1)])
def test_split_attention_matches_causal_attention(context, tensor):
    _split_matches_causal_attention(context, tensor, s=64, d=16)


@pytest.mark.devices(8)
@pytest.mark.parametrize("context, tensor", [(2, 2), (4, 1)])
def test_split_attention_on_the_kernels_matches_causal_attention(context, tensor):
    """Each device's share through the splash kernels (interpret mode): chunks of 128
    tokens, the kernel's smallest block, so 2 x context x 128 tokens."""
    _split_matches_causal_attention(context, tensor, s=2 * context * 128, d=64, kernels=True)


@pytest.mark.parametrize("seq, shards, block", [(1024, 2, 256), (2048, 4, 128),
                                                (4096, 4, 512)])
def test_the_kernel_tables_are_the_splash_librarys(seq, shards, block):
    """:func:`context_attention_tpu.block_tables` (from block extremes) against the tables
    the splash library's own mask processing makes for the same causal mask over the
    zig-zag queries, sharded ``shards`` ways, grid not shrunk."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as mask_lib, splash_attention_mask_info as info_lib)

    mask = mask_lib.CausalMask((seq, seq))
    mask.q_sequence = zigzag_positions(seq, shards).astype(np.int32)
    heads = mask_lib.MultiHeadMask([mask])
    forward, _ = info_lib.process_mask(heads, (block, block), head_shards=1,
                                       q_seq_shards=shards, shrink_grid=False)
    dkv, _ = info_lib.process_mask_dkv(heads, (block, block), head_shards=1,
                                       q_seq_shards=shards, shrink_grid=False)
    tables = context_attention_tpu.block_tables(seq, shards, block)
    for name, want in [("q_sequence", forward.q_sequence), ("block_mask", forward.block_mask),
                       ("data_next", forward.data_next), ("block_mask", dkv.block_mask),
                       ("data_next_dkv", dkv.data_next)]:
        assert tables[name].dtype == want.dtype and np.array_equal(tables[name], want), name


def test_without_a_context_axis_nothing_is_split():
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    with context_attention.sequence_split(mesh, 64) as split:
        assert split is None and context_attention.lowering_key() == ()
