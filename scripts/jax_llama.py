"""The project's Llama written directly in JAX + optax: the yardstick the compiled step is
measured against (``scripts/bench_train_step.py --size``, ``scripts/tpu_cost.py`` and the
TPU cost gate in ``tests/compile/test_tpu_cost_gate.py``).

It is the model of ``tpu_train.models.Llama`` (RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, untied output head), initialised from a torch model's ``state_dict``,
trained with ``optax.clip_by_global_norm`` + ``optax.adamw`` in one ``jax.jit`` step that
donates the parameters and optimizer state and returns the loss and the global gradient norm
(before clipping), as the trainer's compiled step does. It is written the way a JAX user
writes it for XLA, not translated from the torch graph:

* grouped-query attention reshapes the queries to ``[B, KVH, rep, T, D]`` instead of repeating
  K and V, and the causal mask comes from ``iota`` (never a materialized ``tril``);
* linear layers are 2-D dots of ``[B*T, in] @ [in, out]`` (weights stored transposed): each
  weight gradient is then one plain dot with one contracting dimension.

Precision (``precision=``):

* ``"fp32"``: everything in float32;
* ``"bf16"``, the way TPU training stacks do it: float32 master weights and optimizer state,
  weights cast to bfloat16 where they are used, matmuls on bfloat16 operands, activations and
  the residual stream in bfloat16; RMSNorm statistics, the softmax and the loss in float32.

Sizes (:data:`SIZES`): ``w1`` (dim 512, 4 layers, GQA 8/4, ffn 1408, vocab 8192, batch 4 x 256),
``350m`` (dim 1024, 16 layers, GQA 16/8, ffn 2816, vocab 32000, batch 8 x 1024) and ``1b``
(dim 2048, 16 layers, GQA 32/8, ffn 5632, vocab 32000, batch 4 x 2048: 0.85 B parameters).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

PRECISIONS = ("fp32", "bf16")
# jax.checkpoint around each layer: nothing saved (``full``) or the outputs of the weight
# matmuls saved (``dots``: XLA's "dots with no batch dims", which excludes the attention
# scores and values); None: no rematerialization.
REMAT_POLICIES = (None, "full", "dots")


@dataclasses.dataclass(frozen=True)
class Size:
    """A model shape and the batch it is trained on."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int
    batch: int
    seq: int

    def config(self):
        """The ``tpu_train.models.LlamaConfig`` of this size (max_seq_len = the batch's seq)."""
        from tpu_train.models import LlamaConfig

        return LlamaConfig(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, vocab_size=self.vocab_size,
                           ffn_hidden_dim=self.ffn_hidden_dim, max_seq_len=self.seq)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


SIZES: dict[str, Size] = {
    "w1": Size("w1", 512, 4, 8, 4, 1408, 8192, batch=4, seq=256),
    "350m": Size("350m", 1024, 16, 16, 8, 2816, 32000, batch=8, seq=1024),
    "1b": Size("1b", 2048, 16, 32, 8, 5632, 32000, batch=4, seq=2048),
}


@dataclasses.dataclass(frozen=True)
class Hyper:
    """AdamW with weight decay on matrices except the embedding (as the trainer's
    ``tpu_train.trainer.optim.parameter_groups``), clipped to ``max_grad_norm`` (None: not)."""

    lr: float = 3e-4
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0
    decay_embedding: bool = False


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def check_remat(remat: str | None) -> None:
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {remat!r}")


# ------------------------------------------------------------------------------ parameters


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and not name.endswith("norm.weight") \
        and not name.startswith("tok_embeddings")


def params_from_torch(model) -> dict[str, np.ndarray]:
    """Float32 host copies of a torch ``Llama``'s parameters, linear weights as ``[in, out]``.

    The RoPE buffers are not parameters (see :func:`rope_tables`)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("rope_"):
            continue
        value = tensor.detach().to("cpu").float().numpy()
        out[name] = np.ascontiguousarray(value.T) if _is_linear(name) else value
    return out


def rope_tables(model, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """The torch model's ``(cos, sin)`` tables for positions ``0 .. seq - 1``, float32."""
    return (model.rope_cos[:seq].detach().float().numpy(),
            model.rope_sin[:seq].detach().float().numpy())


def param_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of :func:`params_from_torch`'s result for a ``LlamaConfig``."""
    from tpu_train.models import param_shapes as torch_layout

    return {name: shape[::-1] if _is_linear(name) else shape
            for name, shape in torch_layout(cfg).items()}


# ------------------------------------------------------------------------------ the model


class _Ops:
    """The model's building blocks at one precision."""

    def __init__(self, cfg, precision: str):
        import jax.numpy as jnp

        check_precision(precision)
        self.cfg = cfg
        self.compute = jnp.bfloat16 if precision == "bf16" else jnp.float32

    def weight(self, w):
        return w.astype(self.compute)  # a no-op in fp32; the bf16 cast at use otherwise

    def linear(self, x, w):
        flat = x.reshape(-1, x.shape[-1]) @ self.weight(w)
        return flat.reshape(x.shape[:-1] + (w.shape[1],))

    def rms_norm(self, x, w):
        import jax
        import jax.numpy as jnp

        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True)
                                     + self.cfg.norm_eps)
        return normed.astype(self.compute) * self.weight(w)

    def rotary(self, x, cos, sin):
        import jax.numpy as jnp

        half = x.shape[-1] // 2
        cos, sin = cos.astype(x.dtype)[:, None, :], sin.astype(x.dtype)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def attention(self, q, k, v):
        """Causal GQA: q ``[B, T, H, D]``, k/v ``[B, T, KVH, D]`` -> ``[B, T, H * D]``."""
        import jax
        import jax.numpy as jnp

        b, t, h, d = q.shape
        kvh = k.shape[2]
        q = q.reshape(b, t, kvh, h // kvh, d) * jnp.asarray(1 / math.sqrt(d), q.dtype)
        scores = jnp.einsum("btkrd,bskd->bkrts", q, k).astype(jnp.float32)
        rows = jax.lax.broadcasted_iota(jnp.int32, (t, t), 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, (t, t), 1)
        scores = jnp.where(rows >= cols, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkrts,bskd->btkrd", probs, v)
        return out.reshape(b, t, h * d)

    def block(self, x, lp, cos, sin):
        import jax

        cfg = self.cfg
        b, t, _ = x.shape
        hd = cfg.head_dim
        y = self.rms_norm(x, lp["attention_norm.weight"])
        q = self.linear(y, lp["attention.wq.weight"]).reshape(b, t, cfg.n_heads, hd)
        k = self.linear(y, lp["attention.wk.weight"]).reshape(b, t, cfg.n_kv_heads, hd)
        v = self.linear(y, lp["attention.wv.weight"]).reshape(b, t, cfg.n_kv_heads, hd)
        q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        x = x + self.linear(self.attention(q, k, v), lp["attention.wo.weight"])
        y = self.rms_norm(x, lp["ffn_norm.weight"])
        hidden = (jax.nn.silu(self.linear(y, lp["feed_forward.w1.weight"]))
                  * self.linear(y, lp["feed_forward.w3.weight"]))
        return x + self.linear(hidden, lp["feed_forward.w2.weight"])


def loss_fn(params: dict, tokens, labels, cos, sin, cfg, *, precision: str = "fp32",
            remat: str | None = None):
    """Mean next-token cross-entropy of ``tokens`` ``[B, T]`` against ``labels``."""
    import jax
    import jax.numpy as jnp

    check_remat(remat)
    ops = _Ops(cfg, precision)
    # Gather the rows, then cast: the whole table is never converted.
    x = jnp.take(params["tok_embeddings.weight"], tokens, axis=0).astype(ops.compute)
    block = ops.block
    if remat == "full":
        block = jax.checkpoint(block)
    elif remat == "dots":
        block = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    for i in range(cfg.n_layers):
        prefix = f"layers.{i}."
        layer = {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
        x = block(x, layer, cos, sin)
    return head_loss(ops, params, x, labels)


def head_loss(ops: _Ops, params: dict, x, labels):
    """The final norm, the output head (the embedding's transpose when tied) and the mean
    cross-entropy of the decoder's output ``x`` against ``labels``."""
    import jax
    import jax.numpy as jnp

    x = ops.rms_norm(x, params["norm.weight"])
    head = params["output.weight"] if "output.weight" in params \
        else params["tok_embeddings.weight"].T
    logits = ops.linear(x, head).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


# ------------------------------------------------------------------------------ the step


def decay_mask(params: dict, hyper: Hyper) -> dict:
    """Which parameters get weight decay: matrices, the embedding only if ``decay_embedding``."""
    return {name: len(p.shape) >= 2 and (hyper.decay_embedding
                                         or not name.startswith("tok_embeddings"))
            for name, p in params.items()}


def optimizer(params: dict, hyper: Hyper):
    """``optax`` AdamW (decoupled weight decay, as ``torch.optim.AdamW``), clipped first."""
    import optax

    adamw = optax.adamw(hyper.lr, b1=hyper.b1, b2=hyper.b2, eps=hyper.eps,
                        weight_decay=hyper.weight_decay, mask=decay_mask(params, hyper))
    if hyper.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(hyper.max_grad_norm), adamw)


def make_train_step(cfg, opt, *, precision: str = "fp32", remat: str | None = None,
                    jit_kwargs: dict | None = None):
    """``step(params, opt_state, tokens, labels, cos, sin) -> (params, opt_state, loss,
    grad_norm)``, jitted with the parameters and optimizer state donated."""
    import jax
    import optax

    check_precision(precision)
    check_remat(remat)

    def step(params, opt_state, tokens, labels, cos, sin):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels, cos, sin, cfg,
                                                  precision=precision, remat=remat)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grad_norm

    return jax.jit(step, donate_argnums=(0, 1), **(jit_kwargs or {}))


def abstract_arguments(cfg, size: Size, hyper: Hyper, sharding=None) -> tuple:
    """``jax.ShapeDtypeStruct`` arguments of :func:`make_train_step`'s step (for ``.lower``
    without values, e.g. for a TPU that is not here), each placed by ``sharding``."""
    import jax
    import jax.numpy as jnp

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    shapes = param_shapes(cfg)
    params = {n: spec(s, jnp.float32) for n, s in shapes.items()}
    opt_state = jax.eval_shape(optimizer(params, hyper).init, params)
    opt_state = jax.tree.map(lambda a: spec(a.shape, a.dtype), opt_state)
    tokens = spec((size.batch, size.seq), jnp.int32)
    half = cfg.head_dim // 2
    table = spec((size.seq, half), jnp.float32)
    return params, opt_state, tokens, tokens, table, table


class Reference:
    """The reference training on one JAX device, from a torch ``Llama``'s weights."""

    def __init__(self, model, size: Size, hyper: Hyper, device, *, precision: str = "fp32",
                 remat: str | None = None):
        import jax

        self.jax = jax
        self.device = device
        host = params_from_torch(model)
        self.opt = optimizer(host, hyper)
        self.params = jax.device_put(host, device)
        self.opt_state = jax.device_put(self.opt.init(host), device)
        self.cos, self.sin = (jax.device_put(t, device) for t in rope_tables(model, size.seq))
        self.step_fn = make_train_step(model.config, self.opt, precision=precision, remat=remat)
        self.compiled = None
        self.stages: dict[str, float] = {}

    def _put(self, array) -> Any:
        if isinstance(array, self.jax.Array):  # put before (put_batch)
            return array
        return self.jax.device_put(np.asarray(array, dtype=np.int32), self.device)

    def put_batch(self, batch: dict) -> dict:
        """``batch``'s arrays on the device now, for a later :meth:`step`."""
        return {key: self._put(value) for key, value in batch.items()}

    def compile(self, tokens, labels) -> None:
        import time

        start = time.perf_counter()
        lowered = self.step_fn.lower(self.params, self.opt_state, tokens, labels, self.cos,
                                     self.sin)
        lowered_at = time.perf_counter()
        self.compiled = lowered.compile()
        self.stages = {"trace_lower_s": round(lowered_at - start, 3),
                       "xla_compile_s": round(time.perf_counter() - lowered_at, 3)}

    @property
    def compile_s(self) -> float:
        return sum(self.stages.values())

    def step(self, batch: dict) -> tuple:
        """One update on ``{"tokens", "labels"}`` (host int arrays): ``(loss, grad_norm)``."""
        tokens, labels = self._put(batch["tokens"]), self._put(batch["labels"])
        if self.compiled is None:
            self.compile(tokens, labels)
        self.params, self.opt_state, loss, grad_norm = self.compiled(
            self.params, self.opt_state, tokens, labels, self.cos, self.sin)
        return loss, grad_norm

    def block(self, value) -> None:
        self.jax.block_until_ready((self.params, value))
