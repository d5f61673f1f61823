"""Foreach and fused-optimizer lowerings against PyTorch's own kernels on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch

from tests.ops.lowering_check import assert_lowering_matches, to_torch
from tests.ops.lowering_check import to_jax as _to_jax
from tests.tolerances import elementwise_rtol, rtol_for
from tpu_train.ops import (activations, comparison, conversion, foreach,  # noqa: F401
                           pointwise, reduction)
from tpu_train.ops.registry import aten, get_lowering


def to_jax(tensor):
    # A private copy: on the CPU backend a JAX array may share the numpy buffer it came from,
    # and the in-place torch kernels below would then update it too.
    return _to_jax(tensor.clone()) if isinstance(tensor, torch.Tensor) else tensor


def tolerance(dtype, ulps="default", roundings=1, n=1, scale=1.0, steps=1):
    """assert_close's (atol, rtol) (tests/tolerances.py): ``steps`` repetitions (optimizer
    steps, accumulating linearly) of an elementwise chain of accuracy ``ulps`` (a key of
    ELEMENTWISE_ULPS, or the number of correctly rounded operations), a 16-bit dtype computed
    in float32 and rounded ``roundings`` times, plus a reduction of length ``n`` (the norms):
    steps * (elementwise_rtol + rtol_for(float32, n) if n > 1). Outputs that cancel to near
    zero (a - b, lerp, a momentum buffer) get atol = rtol at ``scale``, the inputs' size."""
    rtol = elementwise_rtol(dtype, ulps, roundings) + (rtol_for(torch.float32, n) if n > 1 else 0.0)
    rtol *= steps
    return dict(atol=rtol * scale, rtol=rtol)


def largest(group):
    return max(float(t.float().abs().max()) for t in group if t.numel())


def tensors(seed, dtype=torch.float32, positive=False):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (5,), (), (2, 1, 3)]
    made = [torch.randn(s, generator=generator).to(dtype) for s in shapes]
    return [t.abs() + 0.5 for t in made] if positive else made


def test_every_functional_foreach_overload_resolves_to_a_lowered_op():
    for op in foreach.foreach_overloads():
        if op._schema.name.split("::")[1] in foreach._NOT_PER_TENSOR:
            continue
        target, _ = foreach._resolve(op)
        assert get_lowering(op) is not None, op
        assert get_lowering(target) is not None, f"{op} resolves to unlowered {target}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_binary_overloads(dtype):
    a, b = tensors(0, dtype), tensors(1, dtype, positive=True)
    # One elementwise op (pow the least accurate: "default"), rounded once to bf16; sums and
    # differences cancel: atol at the inputs' size times the largest scalar / alpha (3).
    tol = tolerance(dtype, scale=3 * largest(a + b))
    check = lambda op, *args, **kw: assert_lowering_matches(op, *args, **tol, **kw)  # noqa: E731
    check(aten._foreach_add.List, a, b, alpha=0.5)
    check(aten._foreach_add.Scalar, a, 2.5)
    check(aten._foreach_add.ScalarList, a, [1, 2.5, -1.0, 3])
    check(aten._foreach_add.Tensor, a, torch.tensor(0.25), alpha=2)
    check(aten._foreach_sub.List, a, b, alpha=3)
    check(aten._foreach_mul.Tensor, a, torch.tensor(1.5))
    check(aten._foreach_mul.ScalarList, a, [0.1, 2, 3.0, -1])
    check(aten._foreach_div.List, a, b)
    check(aten._foreach_div.Scalar, a, 3.0)
    check(aten._foreach_maximum.List, a, b)
    check(aten._foreach_maximum.Scalar, a, 0.1)
    check(aten._foreach_minimum.ScalarList, a, [0.0, 0.5, 1.0, -0.5])
    check(aten._foreach_clamp_min.Scalar, a, 0.0)
    check(aten._foreach_clamp_max.List, a, b)
    check(aten._foreach_pow.Scalar, b, 2)
    check(aten._foreach_pow.ScalarList, b, [0.5, 2, 3.0, 1.5])
    check(aten._foreach_pow.List, b, a)
    check(aten._foreach_pow.ScalarAndTensor, 2.0, a)
    check(aten._foreach_copy.default, a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ternary_unary_and_norm(dtype):
    a, b, c = tensors(0, dtype), tensors(1, dtype), tensors(2, dtype, positive=True)
    # Two elementwise ops (addcdiv: a + v * b / c; a unary function of "default" accuracy),
    # each possibly rounded to bf16; the norms reduce the largest tensor (12 elements). Sums
    # cancel: atol at the inputs' size (b / c up to ~2 |b|).
    tol = tolerance(dtype, roundings=2, n=12, scale=2 * largest(a + b + c))
    check = lambda op, *args, **kw: assert_lowering_matches(op, *args, **tol, **kw)  # noqa: E731
    check(aten._foreach_addcdiv.Scalar, a, b, c, -0.5)
    check(aten._foreach_addcdiv.ScalarList, a, b, c, [0.1, 0.2, 0.3, 0.4])
    check(aten._foreach_addcdiv.Tensor, a, b, c, torch.tensor([0.1, 0.2, 0.3, 0.4]))
    check(aten._foreach_addcmul.Scalar, a, b, c, 2.0)
    check(aten._foreach_addcmul.Tensor, a, b, c, torch.tensor([1.0, -1.0, 0.5, 2.0]))
    check(aten._foreach_lerp.Scalar, a, b, 0.3)
    check(aten._foreach_lerp.ScalarList, a, b, [0.3, 0.9, 0.1, 0.5])
    check(aten._foreach_lerp.List, a, b, [t.abs().clamp_max(1) for t in c])
    for name in ("sqrt", "rsqrt", "exp", "neg", "abs", "reciprocal", "sign", "sigmoid", "zero",
                 "trunc"):
        check(getattr(aten, f"_foreach_{name}").default, c)
    check(aten._foreach_max.default, a)
    for ord in (2, 1, float("inf")):
        check(aten._foreach_norm.Scalar, a, ord)
    check(aten._foreach_norm.Scalar, a, 2, torch.float32)


def test_traced_scalars_inside_jit():
    a, b = tensors(0), tensors(1)
    lowering = get_lowering(aten._foreach_add.List).fn
    got = jax.jit(lambda x, y, alpha: lowering(x, y, alpha=alpha))(
        [to_jax(t) for t in a], [to_jax(t) for t in b], jnp.float32(0.3))
    for g, x, y in zip(got, a, b):
        torch.testing.assert_close(to_torch(g, torch.float32), x + 0.3 * y)


# ----------------------------------------------------------------------------- fused optimizers


def optimizer_state(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (7,), (2, 2, 2)]
    params = [torch.randn(s, generator=generator).to(dtype) for s in shapes]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    max_sqs = [torch.zeros_like(p) for p in params]
    return params, exp_avgs, exp_avg_sqs, max_sqs


def run_adam(op, inplace, dtype, *, amsgrad, maximize, weight_decay, tensor_lr, grad_scale,
             found_inf_at, steps=4):
    torch_state = optimizer_state(dtype)
    jax_state = [[to_jax(t) for t in group] for group in torch_state]
    lr = torch.tensor(0.01) if tensor_lr else 0.01
    for step in range(1, steps + 1):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(dtype)
                 for p in torch_state[0]]
        steps_t = [torch.tensor(float(step)) for _ in grads]
        scale = torch.tensor(4.0) if grad_scale else None
        found_inf = torch.tensor(1.0 if step == found_inf_at else 0.0) \
            if found_inf_at is not None else None
        scaled_grads = [g * 4 for g in grads] if grad_scale else [g.clone() for g in grads]
        jax_grads = [to_jax(g) for g in scaled_grads]
        kwargs = dict(lr=lr, beta1=0.9, beta2=0.99, weight_decay=weight_decay, eps=1e-8,
                      amsgrad=amsgrad, maximize=maximize, grad_scale=scale, found_inf=found_inf)
        inplace(torch_state[0], scaled_grads, torch_state[1], torch_state[2],
                torch_state[3] if amsgrad else [], steps_t, **kwargs)
        jax_kwargs = {k: (to_jax(v) if isinstance(v, torch.Tensor) else v)
                      for k, v in kwargs.items()}
        params, grads_out, avgs, sqs, maxes = get_lowering(op).fn(
            jax_state[0], jax_grads, jax_state[1], jax_state[2],
            jax_state[3] if amsgrad else [], [to_jax(s) for s in steps_t], **jax_kwargs)
        jax_state = [params, avgs, sqs, maxes if amsgrad else jax_state[3]]
        # The gradients come back unscaled: one division (by a power of 2).
        tol = tolerance(dtype, "arithmetic", scale=largest(scaled_grads))
        for got, expected in zip(grads_out, scaled_grads):
            torch.testing.assert_close(to_torch(got, dtype), expected, **tol)
    # Each Adam step is an elementwise chain of ~12 operations (the moments, the bias
    # corrections' pow, sqrt, the division, the decay and the update: 15 u with pow / sqrt at
    # 3 u), no reduction; bf16 rounds the parameter and both moments once a step. The errors
    # accumulate linearly over the steps; the moments cancel across steps of opposite-signed
    # gradients: atol at each state's size.
    for got_group, expected_group in zip(jax_state, torch_state):
        if not amsgrad and got_group is jax_state[3]:
            continue
        tol = tolerance(dtype, 15, steps=steps, scale=largest(expected_group))
        for got, expected in zip(got_group, expected_group):
            torch.testing.assert_close(to_torch(got, dtype), expected, **tol)


ADAM_CASES = [
    dict(amsgrad=False, maximize=False, weight_decay=0.0, tensor_lr=False, grad_scale=False,
         found_inf_at=None),
    dict(amsgrad=True, maximize=False, weight_decay=0.1, tensor_lr=False, grad_scale=False,
         found_inf_at=None),
    dict(amsgrad=False, maximize=True, weight_decay=0.05, tensor_lr=True, grad_scale=True,
         found_inf_at=2),
]


@pytest.mark.parametrize("case", ADAM_CASES, ids=range(len(ADAM_CASES)))
@pytest.mark.parametrize("adamw", [False, True])
def test_fused_adam_matches_torch_over_steps(case, adamw):
    op = aten._fused_adamw if adamw else aten._fused_adam
    overload = op.tensor_lr if case["tensor_lr"] else op.default
    inplace = torch._fused_adamw_ if adamw else torch._fused_adam_
    run_adam(overload, inplace, torch.float32, **case)


def test_fused_adamw_bf16_params():
    run_adam(aten._fused_adamw.default, torch._fused_adamw_, torch.bfloat16, amsgrad=False,
             maximize=False, weight_decay=0.01, tensor_lr=False, grad_scale=False,
             found_inf_at=None, steps=2)


@pytest.mark.parametrize("momentum, nesterov, dampening", [(0.0, False, 0.0), (0.9, False, 0.1),
                                                           (0.9, True, 0.0)])
@pytest.mark.parametrize("grad_scale", [False, True])
def test_fused_sgd_matches_torch_over_steps(momentum, nesterov, dampening, grad_scale):
    params = optimizer_state(torch.float32)[0]
    buffers = [torch.zeros_like(p) for p in params] if momentum else []
    jax_params, jax_buffers = [to_jax(p) for p in params], [to_jax(b) for b in buffers]
    for step in range(1, 4):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
                 for p in params]
        kwargs = dict(weight_decay=0.01, momentum=momentum, lr=0.1, dampening=dampening,
                      nesterov=nesterov, maximize=step == 2, is_first_step=step == 1,
                      grad_scale=torch.tensor(2.0) if grad_scale else None,
                      found_inf=torch.tensor(float(step == 2)) if grad_scale else None)
        jax_grads = [to_jax(g) for g in grads]
        torch._fused_sgd_(params, grads, buffers, **kwargs)
        jax_kwargs = {k: (to_jax(v) if isinstance(v, torch.Tensor) else v)
                      for k, v in kwargs.items()}
        jax_params, grads_out, jax_buffers = get_lowering(aten._fused_sgd.default).fn(
            jax_params, jax_grads, jax_buffers, **jax_kwargs)
        for got, expected in zip(grads_out, grads):
            torch.testing.assert_close(to_torch(got, torch.float32), expected)
    # Each SGD step is a chain of ~6 correctly rounded operations (weight decay, momentum and
    # dampening, nesterov, lr, the update), accumulating linearly over the 3 steps; the buffers
    # cancel across steps: atol at the tensors' size.
    for got, expected in zip(jax_params + list(jax_buffers), params + buffers):
        tol = tolerance(torch.float32, 6, steps=3, scale=largest(params + buffers))
        torch.testing.assert_close(to_torch(got, torch.float32), expected, **tol)


def test_fused_adamw_traces_with_traced_hyperparameters():
    params, avgs, sqs, _ = optimizer_state(torch.float32)
    grads = [torch.full_like(p, 0.5) for p in params]
    lowering = get_lowering(aten._fused_adamw.default).fn

    def step(p, g, m, v, s, lr, wd):
        return lowering(p, g, m, v, [], s, lr=lr, beta1=0.9, beta2=0.999, weight_decay=wd,
                        eps=1e-8, amsgrad=False, maximize=False)

    as_jax = lambda group: [to_jax(t) for t in group]  # noqa: E731
    steps = [torch.tensor(1.0) for _ in params]
    got = jax.jit(step)(as_jax(params), as_jax(grads), as_jax(avgs), as_jax(sqs), as_jax(steps),
                        jnp.float32(1e-3), jnp.float32(0.1))
    torch._fused_adamw_(params, grads, avgs, sqs, [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
                        weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    for g, e in zip(got[0], params):
        torch.testing.assert_close(to_torch(g, torch.float32), e)


@pytest.mark.parametrize("beta", [0.9, 0.99, 0.999, 0.9999])
def test_fused_adams_bias_corrections_keep_their_digits_in_the_first_steps(beta):
    """1 - beta**t for t = 1..64, the steps where it cancels (1 - 0.999 = 0.001): within
    SAFETY x 2 roundings per bit of t of the double-precision value PyTorch's CPU kernel uses
    (float32 1 - pow(beta, 1) is 216 u off for 0.999 from beta's rounding alone), with no
    transcendental function, whose float32 error on a TPU (pow: 76 u) would be multiplied by the
    cancellation."""
    import math

    from tests.tolerances import SAFETY, unit_roundoff

    steps = jnp.arange(1, 65, dtype=jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda s: foreach._one_minus_power(beta, s))(steps))
    assert not any(f" {name}[" in jaxpr or f" {name} " in jaxpr for name in ("pow", "exp", "log")), jaxpr
    got = jax.device_get(foreach._one_minus_power(beta, steps)).astype("float64")
    for t, value in zip(range(1, 65), got):
        exact = -math.expm1(t * math.log(beta))
        bound = SAFETY * 2 * t.bit_length() * unit_roundoff(torch.float32)
        assert abs(value - exact) <= bound * exact, (t, value, exact)
