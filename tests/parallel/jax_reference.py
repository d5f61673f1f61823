"""A hand-written JAX Llama-like training step, the tests' yardstick for the SPMD layer.

It uses the parameter names and ``[out, in]`` weight layout of ``tpu_train.models.Llama``, so
the Llama sharding plan applies to it unchanged, but it is plain ``jax.numpy``: an embedding,
``n_layers`` blocks of RMSNorm + causal grouped-query attention + SwiGLU MLP, a final norm,
the output head, mean cross-entropy, ``jax.grad`` and an AdamW update. Rotary embeddings are
left out: they are elementwise and change nothing about sharding or memory.

Its purposes: check that a plan gives the same loss on every mesh as on one device, measure
per-device memory of sharded parameters and optimizer state, and check the planner's analytic
memory model against XLA's, all without depending on the PyTorch step compiler. A test
yardstick: it lives beside the tests, not in the package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tpu_train.models import param_shapes
from tpu_train.parallel.plans import ShardingPlan, constrain

__all__ = ["abstract_inputs", "adamw_init", "init_params", "loss_fn", "make_train_step"]

ActivationHook = Callable[[str, jax.Array], jax.Array]


def init_params(cfg: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """Host (NumPy, float32) parameters: N(0, 0.02) weights, unit norms."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, np.float32)
        else:
            out[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    return out


def _rms_norm(x, w, eps):
    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def _linear(x, w):
    return x @ w.T  # torch layout: w is [out, in]


def loss_fn(params: dict, tokens: jax.Array, labels: jax.Array, cfg: Any, *,
            act: ActivationHook | None = None, remat: bool = False) -> jax.Array:
    """Mean next-token cross-entropy. ``act(kind, x)`` may constrain activations by role."""
    act = act or (lambda kind, x: x)
    b, t = tokens.shape
    h, kvh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    x = act("hidden", jnp.take(params["tok_embeddings.weight"], tokens, axis=0))
    mask = jnp.tril(jnp.ones((t, t), bool))

    def block(x, lp):
        y = _rms_norm(x, lp["attention_norm.weight"], cfg.norm_eps)
        q = _linear(y, lp["attention.wq.weight"]).reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        k = _linear(y, lp["attention.wk.weight"]).reshape(b, t, kvh, hd).transpose(0, 2, 1, 3)
        v = _linear(y, lp["attention.wv.weight"]).reshape(b, t, kvh, hd).transpose(0, 2, 1, 3)
        k, v = jnp.repeat(k, h // kvh, axis=1), jnp.repeat(v, h // kvh, axis=1)
        q, k, v = act("heads", q), act("heads", k), act("heads", v)
        scores = act("heads", jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(hd))
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
        o = jnp.einsum("bhqk,bhkd->bhqd", probs, v).transpose(0, 2, 1, 3).reshape(b, t, h * hd)
        x = act("hidden", x + _linear(o, lp["attention.wo.weight"]))
        y = _rms_norm(x, lp["ffn_norm.weight"], cfg.norm_eps)
        gate = act("ffn", _linear(y, lp["feed_forward.w1.weight"]))
        up = act("ffn", _linear(y, lp["feed_forward.w3.weight"]))
        return act("hidden", x + _linear(jax.nn.silu(gate) * up, lp["feed_forward.w2.weight"]))

    if remat:
        block = jax.checkpoint(block)
    for i in range(cfg.n_layers):
        prefix = f"layers.{i}."
        x = block(x, {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)})
    x = _rms_norm(x, params["norm.weight"], cfg.norm_eps)
    head = params["tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"]
    logits = act("logits", _linear(x, head))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def adamw_init(params: dict) -> dict:
    """AdamW state: two float32 moments per parameter and a step count."""
    def zeros():  # distinct buffers per moment: both are donated to the step
        return {n: jnp.zeros_like(p, dtype=jnp.float32) for n, p in params.items()}

    return {"exp_avg": zeros(), "exp_avg_sq": zeros(), "step": jnp.zeros((), jnp.int32)}


def _adamw(params, grads, state, lr, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    step = state["step"] + 1
    c1 = 1 - b1 ** step.astype(jnp.float32)
    c2 = 1 - b2 ** step.astype(jnp.float32)
    new_p, new_m, new_v = {}, {}, {}
    for n, p in params.items():
        m = b1 * state["exp_avg"][n] + (1 - b1) * grads[n]
        v = b2 * state["exp_avg_sq"][n] + (1 - b2) * grads[n] ** 2
        new_p[n] = p - lr * ((m / c1) / (jnp.sqrt(v / c2) + eps) + wd * p)
        new_m[n], new_v[n] = m, v
    return new_p, {"exp_avg": new_m, "exp_avg_sq": new_v, "step": step}


def _shardings(cfg: Any, mesh, plan: ShardingPlan):
    """(param, optimizer-state, batch) shardings for ``cfg`` under ``plan`` on ``mesh``."""
    shapes = param_shapes(cfg)
    ps = {n: plan.sharding_for(n, s, mesh) for n, s in shapes.items()}
    opt = {"exp_avg": ps, "exp_avg_sq": dict(ps), "step": NamedSharding(mesh, PartitionSpec())}
    batch = NamedSharding(mesh, plan.activation("tokens"))
    return ps, opt, batch


def make_train_step(cfg: Any, mesh=None, plan: ShardingPlan | None = None, *,
                    lr: float = 1e-3, remat: bool = False, constrain_activations: bool = True):
    """``step(params, opt_state, tokens, labels) -> (params, opt_state, loss)``, jitted.

    With a ``mesh`` and ``plan``, inputs and outputs carry the plan's shardings (parameters and
    optimizer state donated, so they are updated in place) and, if ``constrain_activations``,
    activations are pinned to the plan's activation specs.
    """
    act = None
    if mesh is not None and plan is not None and constrain_activations:
        def act(kind, x):
            return constrain(x, plan.activations.get(kind), mesh)

    def step(params, opt_state, tokens, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels, cfg, act=act,
                                                  remat=remat)
        params, opt_state = _adamw(params, grads, opt_state, lr)
        return params, opt_state, loss

    if mesh is None or plan is None:
        return jax.jit(step, donate_argnums=(0, 1))
    ps, opt, batch = _shardings(cfg, mesh, plan)
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(step, in_shardings=(ps, opt, batch, batch),
                   out_shardings=(ps, opt, replicated), donate_argnums=(0, 1))


def abstract_inputs(cfg: Any, batch: int, seq_len: int, mesh, plan: ShardingPlan):
    """``jax.ShapeDtypeStruct`` arguments of the step, with shardings, for AOT ``.lower``."""
    ps, opt, bsh = _shardings(cfg, mesh, plan)
    shapes = param_shapes(cfg)
    params = {n: jax.ShapeDtypeStruct(s, jnp.float32, sharding=ps[n]) for n, s in shapes.items()}
    moments = {n: jax.ShapeDtypeStruct(s, jnp.float32, sharding=ps[n]) for n, s in shapes.items()}
    state = {"exp_avg": moments, "exp_avg_sq": dict(moments),
             "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=opt["step"])}
    tok = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=bsh)
    return params, state, tok, tok
