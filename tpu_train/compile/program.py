"""Build the XLA program of one training step from its two traced graphs.

``program(params, states, consts, batch, scalars[, key])`` takes the parameters and optimizer
state as flat buffers (exactly the ``tpu`` storages' buffers, so donation lets XLA update them
in place) and returns the new flat buffers, the new values of mutated buffers, and the loss,
gradient norm and learning rate. Gradient accumulation runs the gradient graph under
``lax.scan`` over micro-batches: program size and compile time do not grow with the number of
micro-batches.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import jax
import jax.numpy as jnp
import torch

from tpu_train.compile import interpreter, tracing
from tpu_train.ops import registry

aten = torch.ops.aten


@dataclasses.dataclass
class Program:
    """A compiled step and what the caller needs to feed and unpack it."""

    executable: Any
    random: bool
    mutated_consts: tuple  # positions in the constants list whose values the step rewrites
    grad_norm_dtype: torch.dtype
    grad_graph: torch.fx.GraphModule
    update_graph: torch.fx.GraphModule


def _has_random_ops(gm: torch.fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            lowering = registry.get_lowering(node.target)
            if lowering is not None and lowering.random:
                return True
    return False


def _mutated_placeholders(gm: torch.fx.GraphModule) -> list[int]:
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written = set()
    for node in gm.graph.nodes:
        for position in interpreter.written_arguments(node):
            if node.args[position] in placeholders:
                written.add(placeholders[node.args[position]])
    return sorted(written)


def build_program(step, st, values, scalars, device, stages) -> Program:
    """Trace, lower and compile the step for the tensors in ``st`` (see ``train_step``)."""
    fakes = tracing.FakeFactory()
    k = step.grad_accum_steps
    tpu_device = st.params[0].device

    def fake(t, shape=None):
        return fakes.like(t.shape if shape is None else shape, t.dtype, tpu_device)

    param_fakes = [fake(p) for p in st.params]
    const_fakes = [fake(c) for c in st.consts]
    batch_fakes = [fake(b, (b.shape[0] // k,) + tuple(b.shape[1:])) for b in st.batch_leaves]
    grad_gm, weighted = stages.time("trace", tracing.trace_grad_graph, step.model, step.loss_fn,
                          st.param_names, st.const_names, st.batch_spec, fakes,
                          param_fakes, const_fakes, batch_fakes)
    groups = step.optimizer.param_groups
    settings = [dict(step.adapter.static_settings(g)) for g in groups]
    # The update is elementwise per tensor (plus the global norm, a full reduction), so it
    # is traced on flat tensors: it then reads and writes exactly the flat storage buffers,
    # and XLA updates the donated buffers in place. (Traced on 2-D shapes, with the flat
    # buffers reshaped around it, XLA's CPU backend copied every parameter and optimizer
    # state buffer once per step.)
    flat_param_fakes = [fake(p, (p.numel(),)) for p in st.params]
    state_fakes = [fake(s, (s.numel(),)) for s in st.states]
    grad_fakes = [fake(p, (p.numel(),)) for p in st.params]
    scalars_fake = fakes.like(scalars.shape, torch.float32, tpu_device)
    update_gm = stages.time("trace", tracing.trace_update_graph, step.adapter, settings,
                            st.group_sizes, st.state_counts, step.max_grad_norm, fakes,
                            flat_param_fakes, grad_fakes, state_fakes, scalars_fake)
    interpreter.check_lowerings(grad_gm.graph)
    interpreter.check_lowerings(update_gm.graph)
    stages.graph_nodes = interpreter.count_ops(grad_gm) + interpreter.count_ops(update_gm)

    n_params, n_consts = len(st.params), len(st.consts)
    mutated = tuple(i - n_params for i in _mutated_placeholders(grad_gm)
                    if n_params <= i < n_params + n_consts)
    random = _has_random_ops(grad_gm)
    param_shapes = [tuple(p.shape) for p in st.params]
    grad_norm_node = [n for n in update_gm.graph.nodes if n.op == "output"][0].args[0][-1]
    grad_norm_dtype = grad_norm_node.meta["val"].dtype

    def gradients(params, consts, batch, key):
        outputs, mutations = interpreter.run_graph(grad_gm, params + consts + batch, rng_key=key)
        new_consts = [mutations.get(n_params + i, consts[i]) for i in range(n_consts)]
        return outputs[:-2], outputs[-2], outputs[-1], new_consts

    def normalise(grads, loss, total):
        # Plain losses: the mean over micro-batches. (loss_sum, count) losses: sums over the
        # total count, so every counted item weighs the same (an empty step divides by 1).
        if not weighted:
            if k == 1:
                return list(grads), loss
            return [(g / k).astype(g.dtype) for g in grads], loss / k
        total = jnp.where(total > 0, total, 1.0)
        return [(g / total.astype(g.dtype)).astype(g.dtype) for g in grads], loss / total

    def accumulate(params, consts, batch, key):
        micro = [b.reshape((k, b.shape[0] // k) + b.shape[1:]) for b in batch]

        def body(carry, xs):
            grad_sum, loss_sum, weight_sum, carried = carry
            micro_batch, i = xs
            current = list(consts)
            for position, value in zip(mutated, carried):
                current[position] = value
            micro_key = None if key is None else jax.random.fold_in(key, i)
            grads, loss, weight, new_consts = gradients(params, current, list(micro_batch),
                                                        micro_key)
            grad_sum = [a + g.astype(a.dtype) for a, g in zip(grad_sum, grads)]
            return (grad_sum, loss_sum + loss, weight_sum + weight,
                    [new_consts[p] for p in mutated]), None

        init = ([jnp.zeros_like(p) for p in params], jnp.zeros((), jnp.float32),
                jnp.zeros((), jnp.float32), [consts[p] for p in mutated])
        (grad_sum, loss_sum, weight_sum, carried), _ = jax.lax.scan(
            body, init, (micro, jnp.arange(k)))
        new_consts = list(consts)
        for position, value in zip(mutated, carried):
            new_consts[position] = value
        grads, loss = normalise(grad_sum, loss_sum, weight_sum)
        return grads, loss, new_consts

    def program(param_flat, state_flat, consts, batch, scalars_in, key=None):
        params = [a.reshape(s) for a, s in zip(param_flat, param_shapes)]
        if k == 1:
            grads, loss, weight, new_consts = gradients(params, list(consts), list(batch), key)
            grads, loss = normalise(grads, loss, weight)
        else:
            grads, loss, new_consts = accumulate(params, list(consts), list(batch), key)
        flat_grads = [g.reshape(-1) for g in grads]
        outputs, _ = interpreter.run_graph(
            update_gm, list(param_flat) + flat_grads + list(state_flat) + [scalars_in])
        return (outputs[:n_params], outputs[n_params:-1], [new_consts[p] for p in mutated],
                loss, outputs[-1], scalars_in[0, 0])

    jitted = jax.jit(program, donate_argnums=(0, 1) if step.donate else ())
    args = [values["params"], values["states"], values["consts"], values["batch"],
            jax.device_put(scalars, device)]
    if random:
        args.append(jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                                         sharding=jax.sharding.SingleDeviceSharding(device)))
    lowered = stages.time("lower", jitted.lower, *args)
    executable = stages.time("compile", lowered.compile)
    return Program(executable, random, mutated, grad_norm_dtype, grad_gm, update_gm)
