"""The JAX reference of ``scripts/jax_llama.py`` built the way MaxText builds its decoder: the
layers' parameters stacked on a leading layer axis and run under one ``lax.scan``, each layer
under ``jax.checkpoint`` with a remat policy, and on a TPU Pallas splash attention (JAX's
``splash_attention`` kernels, their own backward) from a sequence of 1,024 on. Everything else
(the model, the bf16 recipe, optax AdamW with clipping, the donated jitted step) is
``jax_llama``'s, so the two references differ only in the program's shape.

It is the compile-time yardstick: a scanned program holds one layer's body, so XLA compiles it
once, however deep the stack (``scripts/bench_train_step.py --size S --only jax_scan``;
``scripts/tpu_compile.py`` compiles it for a v5e without a chip).
"""

from __future__ import annotations

import math

import numpy as np

import jax_llama

# From this sequence on, the TPU attention is the splash kernel (shorter: the XLA form).
SPLASH_MIN_SEQ = 1024
LAYER_PREFIX = "layers."


def stack_layers(params: dict, n_layers: int) -> dict:
    """``jax_llama``'s flat ``{name: array}`` as ``{"layers": {name: [L, ...]}, name: array}``."""
    out: dict = {"layers": {}}
    for name, value in params.items():
        if not name.startswith(LAYER_PREFIX):
            out[name] = value
    first = f"{LAYER_PREFIX}0."
    for name in (n[len(first):] for n in params if n.startswith(first)):
        out["layers"][name] = np.stack([params[f"{LAYER_PREFIX}{i}.{name}"]
                                        for i in range(n_layers)])
    return out


def stacked_shapes(cfg) -> dict:
    """:func:`stack_layers`'s structure as shapes, for a ``LlamaConfig``."""
    flat = jax_llama.param_shapes(cfg)
    out: dict = {"layers": {}}
    first = f"{LAYER_PREFIX}0."
    for name, shape in flat.items():
        if name.startswith(first):
            out["layers"][name[len(first):]] = (cfg.n_layers, *shape)
        elif not name.startswith(LAYER_PREFIX):
            out[name] = shape
    return out


def decay_mask(params: dict, hyper: jax_llama.Hyper) -> dict:
    """Weight decay on the matrices (a stacked layer matrix is 3-D), not the embedding unless
    ``decay_embedding``: the same parameters as ``jax_llama.decay_mask``."""
    mask = {name: value.ndim >= 2 and (hyper.decay_embedding or not name.startswith("tok_"))
            for name, value in params.items() if name != "layers"}
    mask["layers"] = {name: value.ndim >= 3 for name, value in params["layers"].items()}
    return mask


def optimizer(params: dict, hyper: jax_llama.Hyper):
    import optax

    adamw = optax.adamw(hyper.lr, b1=hyper.b1, b2=hyper.b2, eps=hyper.eps,
                        weight_decay=hyper.weight_decay, mask=decay_mask(params, hyper))
    if hyper.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(hyper.max_grad_norm), adamw)


def _splash_kernel(seq: int, group: int):
    """The causal multi-query splash kernel for ``group`` query heads over one kv head."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib, splash_attention_mask as mask_lib)

    block = 512 if seq % 512 == 0 else 128
    blocks = kernel_lib.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((seq, seq))] * group)
    return kernel_lib.make_splash_mqa_single_device(mask, block_sizes=blocks)


class _ScanOps(jax_llama._Ops):
    """``jax_llama``'s blocks with the splash kernel for attention where it applies."""

    def __init__(self, cfg, precision: str, splash: bool):
        super().__init__(cfg, precision)
        self.splash = splash

    def attention(self, q, k, v):
        if not self.splash:
            return super().attention(q, k, v)
        import jax
        import jax.numpy as jnp

        b, t, h, d = q.shape
        kvh = k.shape[2]
        kernel = _splash_kernel(t, h // kvh)
        q = (q * jnp.asarray(1 / math.sqrt(d), q.dtype)).reshape(b, t, kvh, h // kvh, d)
        q = q.transpose(0, 2, 3, 1, 4)                       # [B, KVH, rep, T, D]
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, KVH, T, D]
        # The kernel's dots take bf16 operands at the default precision (a process-wide
        # "highest" would ask Mosaic for an fp32 contraction it cannot compile for bf16).
        with jax.default_matmul_precision("default"):
            out = jax.vmap(jax.vmap(kernel))(q, k, v)        # [B, KVH, rep, T, D]
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h * d)


def _policy(remat: str | None):
    import jax

    if remat == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint_policies.everything_saveable


def loss_fn(params: dict, tokens, labels, cos, sin, cfg, *, precision: str, remat: str | None,
            splash: bool):
    """Mean next-token cross-entropy, the layers under one ``lax.scan``."""
    import jax
    import jax.numpy as jnp

    jax_llama.check_remat(remat)
    ops = _ScanOps(cfg, precision, splash)
    x = jnp.take(params["tok_embeddings.weight"], tokens, axis=0).astype(ops.compute)

    def body(x, layer):
        return ops.block(x, layer, cos, sin), None

    x, _ = jax.lax.scan(jax.checkpoint(body, policy=_policy(remat)), x, params["layers"])
    return jax_llama.head_loss(ops, params, x, labels)


def make_train_step(cfg, opt, *, precision: str, remat: str | None, splash: bool,
                    jit_kwargs: dict | None = None):
    """``jax_llama.make_train_step``'s step over stacked parameters."""
    import jax
    import optax

    def step(params, opt_state, tokens, labels, cos, sin):
        # JAX's default matmul precision, as a JAX program has it, whatever the process set:
        # the splash kernels' forward and backward dots need it for bf16 operands.
        with jax.default_matmul_precision("default"):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels, cos, sin, cfg,
                                                      precision=precision, remat=remat,
                                                      splash=splash)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grad_norm

    return jax.jit(step, donate_argnums=(0, 1), **(jit_kwargs or {}))


def uses_splash(platform: str, seq: int) -> bool:
    return platform == "tpu" and seq >= SPLASH_MIN_SEQ


def abstract_arguments(cfg, size: jax_llama.Size, hyper: jax_llama.Hyper,
                       sharding=None) -> tuple:
    """``jax.ShapeDtypeStruct`` arguments of the step, for ``.lower`` without values, each
    placed by ``sharding``."""
    import jax
    import jax.numpy as jnp

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    params = jax.tree.map(lambda s: spec(s, jnp.float32), stacked_shapes(cfg),
                          is_leaf=lambda s: isinstance(s, tuple))
    opt_state = jax.eval_shape(optimizer(params, hyper).init, params)
    opt_state = jax.tree.map(lambda a: spec(a.shape, a.dtype), opt_state)
    tokens = spec((size.batch, size.seq), jnp.int32)
    table = spec((size.seq, cfg.head_dim // 2), jnp.float32)
    return params, opt_state, tokens, tokens, table, table


class ScanReference(jax_llama.Reference):
    """:class:`jax_llama.Reference` with the scanned step (remat ``dots`` unless told)."""

    def __init__(self, model, size: jax_llama.Size, hyper: jax_llama.Hyper, device, *,
                 precision: str = "bf16", remat: str | None = "dots"):
        import jax

        self.jax = jax
        self.device = device
        host = stack_layers(jax_llama.params_from_torch(model), size.n_layers)
        self.opt = optimizer(host, hyper)
        self.params = jax.device_put(host, device)
        self.opt_state = jax.device_put(self.opt.init(host), device)
        self.cos, self.sin = (jax.device_put(t, device)
                              for t in jax_llama.rope_tables(model, size.seq))
        self.step_fn = make_train_step(model.config, self.opt, precision=precision, remat=remat,
                                       splash=uses_splash(device.platform, size.seq))
        self.compiled = None
        self.stages = {}
