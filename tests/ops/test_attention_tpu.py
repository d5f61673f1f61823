"""The TPU attention kernels (JAX's Pallas splash attention, ``tpu_train.ops.attention_tpu``)
against PyTorch's SDPA on CPU, run in Pallas' interpret mode on the CPU client through the same
lowerings a TPU program uses, and the rule that chooses them."""

import jax
import jax.numpy as jnp
import numpy
import pytest
import torch
import torch.nn.functional as F

from tests.ops.lowering_check import to_jax, to_torch
from tests.ops.test_attention import largest, rand, tolerance
from tpu_train.ops import attention, attention_tpu

CASES = [
    # (B, Hq, Hkv, S, D, is_causal, scale)
    (1, 4, 2, 256, 64, True, None),   # GQA, two 128-token blocks: the online softmax's rescaling
    (2, 2, 2, 128, 64, True, None),   # one kv head per query head
    (1, 4, 1, 128, 64, False, 0.3),   # MQA, no mask, a scale that is not a power of two
]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts of the kernel entry points the lowerings reached."""
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        original = getattr(attention_tpu, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(attention_tpu, name, counted)
    return calls


def _inputs(case, dtype):
    b, hq, hkv, s, d, is_causal, scale = case
    return (rand(b, hq, s, d, dtype=dtype), rand(b, hkv, s, d, dtype=dtype, seed=1),
            rand(b, hkv, s, d, dtype=dtype, seed=2))


def _torch_reference(q, k, v, is_causal, scale, grad):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    expected.backward(grad)
    return expected.detach(), [leaf.grad for leaf in leaves]


def _check(dtype, n, got_out, expected, got_grads, expected_grads):
    # As tests/ops/test_attention.py derives them: the forward's three chained reductions
    # (q k^T, the softmax's sum, P v) with 3 roundings in a 16-bit dtype (the scaled query,
    # P and the output); the backward's six with 6 (P, dP, dS, and each gradient). The
    # kernels' online softmax adds one float32 rescaling per key block, elementwise.
    torch.testing.assert_close(to_torch(got_out, dtype), expected,
                               **tolerance(dtype, n, 3, 3, largest(expected)))
    for got, want in zip(got_grads, expected_grads):
        assert got.shape == want.shape
        torch.testing.assert_close(to_torch(got, dtype), want,
                                   **tolerance(dtype, n, 6, 6, largest(want)))


@pytest.mark.parametrize("case", CASES, ids=["gqa_causal", "mha_causal", "mqa_scaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_on_the_kernels_match_torch(case, dtype, kernel_calls):
    """The forward op and its backward op (eager mode, PyTorch's traced backward)."""
    b, hq, hkv, s, d, is_causal, scale = case
    q, k, v = _inputs(case, dtype)
    grad = rand(b, hq, s, d, dtype=dtype, seed=5)
    expected, expected_grads = _torch_reference(q, k, v, is_causal, scale, grad)
    with attention_tpu.interpreted():
        out, lse, *_, seed, offset, _ = attention.scaled_dot_product_fused_attention(
            to_jax(q), to_jax(k), to_jax(v), None, 0.0, is_causal, False, scale=scale)
        grads = attention.scaled_dot_product_fused_attention_backward(
            to_jax(grad), to_jax(q), to_jax(k), to_jax(v), None, [True, True, True, False], out,
            lse, None, None, s, s, 0.0, is_causal, seed, offset, scale=scale)
    assert kernel_calls == {"forward": 1, "backward": 1}
    assert lse.shape == (b, hq, s) and lse.dtype == jnp.float32 and grads[3] is None
    _check(dtype, max(d, s), out, expected, grads[:3], expected_grads)
    # The logsumexp the backward consumes is PyTorch's (natural log of the scaled scores).
    from tests.ops.test_attention import reference_logsumexp
    reference = reference_logsumexp(q, k, None, is_causal, scale)
    torch.testing.assert_close(to_torch(lse, torch.float32), reference,
                               **tolerance(dtype, max(d, s), 2, 1, largest(reference)))


@pytest.mark.parametrize("case", CASES[:2], ids=["gqa_causal", "mha_causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jax_derivative_runs_the_backward_kernels(case, dtype, kernel_calls):
    """A compiled step's loss graph: JAX differentiates the forward lowering, whose custom
    derivative calls the backward kernels on the forward's saved output and logsumexp."""
    b, hq, hkv, s, d, is_causal, scale = case
    q, k, v = _inputs(case, dtype)
    grad = rand(b, hq, s, d, dtype=dtype, seed=5)
    expected, expected_grads = _torch_reference(q, k, v, is_causal, scale, grad)

    def loss(q_, k_, v_):
        out = attention.scaled_dot_product_fused_attention(q_, k_, v_, None, 0.0, is_causal,
                                                           False, scale=scale)[0]
        return jnp.sum(out.astype(jnp.float32) * to_jax(grad).astype(jnp.float32)), out

    with attention_tpu.interpreted():
        grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(
            to_jax(q), to_jax(k), to_jax(v))
    assert kernel_calls == {"forward": 1, "backward": 1}
    assert [g.dtype for g in grads] == [to_jax(q).dtype] * 3
    _check(dtype, max(d, s), out, expected, grads, expected_grads)


def _arrays(s=1024, heads=4, kv=2, d=64, dtype=jnp.bfloat16):
    return (jnp.zeros((1, heads, s, d), dtype), jnp.zeros((1, kv, s, d), dtype),
            jnp.zeros((1, kv, s, d), dtype))


def test_the_rule_takes_the_kernels_only_where_they_win():
    assert attention_tpu.supported(*_arrays(), None, True)
    assert attention_tpu.supported(*_arrays(2048, 32, 8), None, False)
    assert not attention_tpu.supported(*_arrays(256), None, True)  # the XLA form is faster
    assert not attention_tpu.supported(*_arrays(), jnp.zeros((1024, 1024)), False)  # a bias
    assert not attention_tpu.supported(*_arrays(), None, True, dropout_p=0.1)
    assert not attention_tpu.supported(*_arrays(1152 + 64), None, True)  # not 128-token tiles
    assert not attention_tpu.supported(*_arrays(d=40), None, True)
    assert not attention_tpu.supported(*_arrays(dtype=jnp.float32), None, True)  # matmul precision
    q, k, v = _arrays()
    assert not attention_tpu.supported(q, k[:, :, :512], v[:, :, :512], None, False)  # Sq != Sk
    with attention_tpu.xla_form():  # a partitioned program
        assert not attention_tpu.supported(*_arrays(), None, True)
    with attention_tpu.interpreted():  # the tests' mode: from 128 tokens, float32 too
        assert attention_tpu.supported(*_arrays(128, dtype=jnp.float32), None, True)


def test_xla_form_elsewhere_and_kernels_only_in_tpu_lowerings(kernel_calls):
    """Outside the interpreted mode, the same program lowered for the CPU runs the XLA form
    (the kernels' branch is traced, not lowered) and gives the XLA form's numbers. The arrays
    are on the CPU client whatever the test platform: a TPU host has it beside the chip."""
    cpu = jax.devices("cpu")[0]
    q, k, v = (jax.device_put(to_jax(t), cpu) for t in _inputs(CASES[0], torch.bfloat16))
    q, k, v = (jnp.tile(x, (1, 1, 4, 1)) for x in (q, k, v))  # 1024 tokens: the rule holds
    assert attention_tpu.supported(q, k, v, None, True)
    fused = jax.jit(lambda *a: attention.scaled_dot_product_fused_attention(
        *a, None, 0.0, True, False)[:2])
    out, lse = fused(q, k, v)
    text = fused.lower(q, k, v).as_text()
    assert "tpu_custom_call" not in text
    xla_out, xla_lse = attention._attention_forward(q, k, v, None, True, None)
    assert bool(jnp.all(out == xla_out)) and bool(jnp.all(lse == xla_lse))


def test_without_a_tpu_compiler_the_kernels_are_not_even_traced(kernel_calls, monkeypatch):
    monkeypatch.setattr(attention_tpu, "_tpu_compiler_installed", lambda: False)
    q, k, v = (jnp.zeros((1, 4 // n, 1024, 64), jnp.bfloat16) for n in (1, 2, 2))
    jax.jit(lambda *a: attention.scaled_dot_product_fused_attention(
        *a, None, 0.0, True, False)[0]).lower(q, k, v)
    assert kernel_calls == {"forward": 0, "backward": 0}
    monkeypatch.setattr(attention_tpu, "_tpu_compiler_installed", lambda: True)
    jax.jit(lambda *a: attention.scaled_dot_product_fused_attention(
        *a, None, 0.0, True, False)[0]).lower(q, k, v)
    assert kernel_calls == {"forward": 1, "backward": 0}


def test_cached_kernels_hold_host_tables_even_when_built_inside_a_trace():
    """Built inside a trace with the kernel library's ``jnp.array``, the mask tables would be
    that trace's tracers; cached and reused by a later trace they became extra parameters of
    its program ("Computation compiled for 456 inputs but called with 446" on the chip)."""
    attention_tpu._kernel.cache_clear()
    seen = []

    @jax.jit
    def build(x):
        seen.append(attention_tpu._kernel(256, 2, True, True))
        return x

    build(jnp.zeros(()))
    leaves = jax.tree_util.tree_leaves(seen[0])
    assert leaves and all(isinstance(leaf, numpy.ndarray) for leaf in leaves)
    attention_tpu._kernel.cache_clear()


def _kernel_dot_precisions(jaxpr) -> list:
    """The precision of every dot inside the Pallas calls of ``jaxpr`` (nested jaxprs too)."""
    found = []

    def walk(closed, inside_kernel):
        inner = getattr(closed, "jaxpr", closed)
        for eqn in inner.eqns:
            kernel = inside_kernel or eqn.primitive.name == "pallas_call"
            if kernel and eqn.primitive.name == "dot_general":
                found.append(eqn.params["precision"])
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        walk(sub, kernel)

    walk(jaxpr, False)
    return found


def test_the_kernels_dots_keep_the_default_precision_under_highest():
    """``trainer.matmul_precision=highest`` is for float32 dots; the kernels' bf16 dots stay at
    the default precision (Mosaic cannot compile a bf16 dot at fp32 contract precision)."""
    from tpu_train.ops.matmul import set_matmul_precision

    q, k, v = (to_jax(t) for t in _inputs(CASES[0], torch.bfloat16))
    set_matmul_precision("highest")  # the conftest resets it after the test
    with attention_tpu.interpreted():
        def both(q, k, v):
            out, logsumexp = attention_tpu.forward(q, k, v, True, None)
            return attention_tpu.backward(out, q, k, v, out, logsumexp, True, None)

        jaxpr = jax.make_jaxpr(both)(q, k, v)
    precisions = _kernel_dot_precisions(jaxpr)
    assert precisions, "no dot inside a Pallas call: the test no longer looks at the kernels"
    highest = jax.lax.Precision.HIGHEST
    assert all(p is None or highest not in p for p in precisions), precisions


@pytest.mark.devices(4)
def test_per_shard_kernels_on_a_mesh_match_torch(kernel_calls):
    """In a program partitioned over a (data=2, tensor=2) mesh the kernels run in a shard_map,
    each device on its row and its kv head with that head's query heads: the forward and the
    JAX derivative match PyTorch's attention of the whole arrays."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    b, hq, hkv, s, d, is_causal, scale = 2, 4, 2, 256, 64, True, None
    q, k, v = _inputs((b, hq, hkv, s, d, is_causal, scale), torch.float32)
    grad = rand(b, hq, s, d, dtype=torch.float32, seed=5)
    expected, expected_grads = _torch_reference(q, k, v, is_causal, scale, grad)
    mesh = Mesh(numpy.array(jax.devices()[:4]).reshape(2, 1, 2), ("data", "fsdp", "tensor"))
    split = NamedSharding(mesh, PartitionSpec("data", "tensor", None, None))

    def loss(q_, k_, v_):
        out = attention.scaled_dot_product_fused_attention(q_, k_, v_, None, 0.0, is_causal,
                                                           False, scale=scale)[0]
        return jnp.sum(out.astype(jnp.float32) * to_jax(grad).astype(jnp.float32)), out

    with attention_tpu.interpreted(), attention_tpu.per_shard(mesh):
        program = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
        args = [jax.device_put(to_jax(t), split) for t in (q, k, v)]
        assert "shard_map" in program.lower(*args).as_text() or \
            "sdy.manual_computation" in program.lower(*args).as_text()
        grads, out = program(*args)
        # One kv head over tensor=2 does not split: the XLA form, which XLA partitions.
        assert not attention_tpu.supported(*(to_jax(t)[:, :1] for t in (q, k, v)), None, True)
    assert kernel_calls == {"forward": 1, "backward": 1}
    _check(torch.float32, max(d, s), out, expected, grads, expected_grads)
