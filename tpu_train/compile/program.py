"""Build the XLA program of one training step from its two traced graphs.

``program(params, states, consts, batch, scalars[, key])`` takes the parameters and optimizer
state as flat buffers (exactly the ``tpu`` storages' buffers, so donation lets XLA update them
in place) and returns the new flat buffers, the new values of mutated buffers, and the loss,
gradient norm and learning rate. Gradient accumulation runs the gradient graph under
``lax.scan`` over micro-batches: program size and compile time do not grow with the number of
micro-batches.

SPMD (``mesh`` and ``plan`` given): the program is jitted with ``in_shardings`` /
``out_shardings`` from :func:`tpu_train.parallel.step_shardings`. The ``tpu`` storages stay flat
(the device layer's invariant), so each parameter / state buffer is a flat *global* array split
over the same mesh axes as its plan spec (:func:`tpu_train.parallel.flat_storage_sharding`):
every device holds ``1 / ways`` of it. Inside the program the flat buffers are reshaped to their
natural shapes and pinned to the plan's sharding, so the forward, backward and update run on the
plan's layout (XLA reshuffles between the two layouts at the program's edges), and the new
values leave flat again. Lowering uses abstract inputs only (``jax.ShapeDtypeStruct`` with
shardings): nothing needs to be allocated to compile, which the ahead-of-time planner uses.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpu_train.compile import interpreter, tracing
from tpu_train.compile.checkpointing import OPTIMIZATION_BARRIER
from tpu_train.device import runtime
from tpu_train.ops import registry
from tpu_train.ops.dtypes import storage_dtype

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
    lowered: Any = None  # the ``jax.stages.Lowered`` (cost and memory analysis)
    in_shardings: Any = None  # SPMD only: what the executable's arguments must be placed as


def place_global(value, sharding):
    """``value`` (the same full array in every process) as a global array with ``sharding``.

    In one process this is ``jax.device_put``. When the mesh spans several processes a device
    cannot receive data from another process's array, so each process builds only the shards
    on its own devices from its copy of the value (every process holds the same batch, the
    same scalars, and the same initial parameters after a seeded initialization or a
    checkpoint load).
    """
    if getattr(value, "sharding", None) == sharding:
        return value
    if sharding.is_fully_addressable or not getattr(value, "is_fully_addressable", True):
        return jax.device_put(value, sharding)  # one process, or global to global (a reshard)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_step_inputs(args, in_shardings) -> list:
    """A compiled SPMD step's positional groups (a list per group, or one array), each placed
    as its ``in_shardings`` entry says (see :func:`place_global`)."""
    placed = []
    for group, sharding in zip(args, in_shardings):
        if isinstance(sharding, (list, tuple)):
            placed.append([place_global(a, s) for a, s in zip(group, sharding)])
        else:
            placed.append(place_global(group, sharding))
    return placed


class _PlacingExecutable:
    """A compiled SPMD step that first places its arguments as the program expects.

    The caller hands in whatever the ``tpu`` tensors hold: batches and constants on one device,
    the RNG key on one device, parameters on one device before their first step. A compiled
    executable accepts only arrays with exactly its input shardings, so each argument is
    ``device_put`` to its sharding; arrays already placed that way (parameters and optimizer
    state after the first step, which the step writes back as global arrays) pass through
    without a copy.
    """

    def __init__(self, compiled, in_shardings):
        self.compiled = compiled
        self.in_shardings = in_shardings

    def __call__(self, *args):
        return self.compiled(*place_step_inputs(args, self.in_shardings))

    def __getattr__(self, name):  # memory_analysis(), cost_analysis(), as_text() ...
        return getattr(self.compiled, name)


def _has_random_ops(gm: torch.fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            lowering = registry.get_lowering(node.target)
            if lowering is not None and lowering.random:
                return True
    return False


def _platform(device, mesh) -> str | None:
    if device is not None:
        return getattr(device, "platform", None)
    devices = getattr(getattr(mesh, "jax_mesh", mesh), "devices", None)
    return devices.flat[0].platform if hasattr(devices, "flat") else None


def compile_lowered(lowered, platform: str | None):
    """``lowered.compile()`` with the device runtime's CPU options where they apply (the eager
    ops take the same ones, so a compiled step rounds like the ops it replaces)."""
    options = runtime.cpu_compiler_options() if platform == "cpu" else {}
    return lowered.compile(dict(options)) if options else lowered.compile()


def _mutated_placeholders(gm: torch.fx.GraphModule) -> list[int]:
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written = set()
    for node in gm.graph.nodes:
        for position in interpreter.written_arguments(node):
            if node.args[position] in placeholders:
                written.add(placeholders[node.args[position]])
    return sorted(written)


def _state_owners(st) -> list[int]:
    """For each optimizer-state tensor, the index of the parameter it belongs to."""
    owners = []
    for i, count in enumerate(st.state_counts):
        owners.extend([i] * count)
    return owners


def _has_checkpointed_regions(gm: torch.fx.GraphModule) -> bool:
    return any(node.target is OPTIMIZATION_BARRIER for node in gm.graph.nodes)


def _activation_constraint(plan, mesh, model, batch_fakes):
    """The plan's activation rule as a function pinning one traced value (None: no rule).

    The rule sees the micro-batch's ``[batch, seq]`` shape (the first batch input's) and
    classifies intermediates by shape; values it does not name are left to XLA.
    """
    factory = getattr(plan, "activation_rule", None)
    if factory is None or not batch_fakes:
        return None
    rule = factory(model, tuple(batch_fakes[0].shape))
    if rule is None:
        return None
    jax_mesh = getattr(mesh, "jax_mesh", mesh)
    cache: dict = {}

    def constrain(value):
        shape = getattr(value, "shape", None)
        if shape is None or not hasattr(value, "dtype"):
            return value
        shape = tuple(shape)
        if shape not in cache:
            spec = rule(shape)
            cache[shape] = None if spec is None else \
                jax.sharding.NamedSharding(jax_mesh, spec)
        sharding = cache[shape]
        return value if sharding is None else jax.lax.with_sharding_constraint(value, sharding)

    return constrain


def build_program(step, st, values, scalars, device, stages, *, mesh=None, plan=None,
                  compile: bool = True) -> Program:
    """Trace, lower and compile the step for the tensors in ``st`` (see ``train_step``).

    ``mesh`` and ``plan`` (both or neither) compile an SPMD program (module docstring).
    ``values`` may be None in SPMD mode: inputs are described from ``st``'s shapes and dtypes
    alone. ``compile=False`` stops after lowering (``Program.executable`` is then None).
    """
    if (mesh is None) != (plan is None):
        raise ValueError("an SPMD step needs both mesh= and plan= (got only "
                         f"{'mesh' if plan is None else 'plan'})")
    spmd = mesh is not None
    if values is None and not spmd:
        raise ValueError("values=None (abstract lowering) needs a mesh and a plan")
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
    # Under SPMD the update runs on natural shapes instead: a flat buffer cannot carry the
    # plan's 2-D tilings, and the update should read the gradients in the plan's layout.
    def update_shape(t):
        return tuple(t.shape) if spmd else (t.numel(),)

    flat_param_fakes = [fake(p, update_shape(p)) for p in st.params]
    state_fakes = [fake(s, update_shape(s)) for s in st.states]
    grad_fakes = [fake(p, update_shape(p)) for p in st.params]
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

    constrain = _activation_constraint(plan, mesh, step.model, batch_fakes) if spmd else None

    def gradients(params, consts, batch, key):
        outputs, mutations = interpreter.run_graph(grad_gm, params + consts + batch, rng_key=key,
                                                   constrain=constrain, at_use=at_use)
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

    state_shapes = [tuple(t.shape) for t in st.states]
    shardings = None
    if spmd:
        from tpu_train.parallel import flat_storage_sharding, step_shardings

        shardings = step_shardings(
            plan, mesh, param_names=st.param_names, param_shapes=param_shapes,
            state_owners=_state_owners(st), state_shapes=state_shapes, num_consts=n_consts,
            batch_shapes=[tuple(b.shape) for b in st.batch_leaves])
        flat_params = [flat_storage_sharding(s) for s in shardings.params]
        flat_states = [flat_storage_sharding(s) for s in shardings.states]

    def pin(value, sharding):
        return jax.lax.with_sharding_constraint(value, sharding)

    # Weights are stored on the plan's layout and used on its compute layout: FSDP's
    # all-gather made explicit (parallel.compute_sharding). Left to sharding propagation, XLA
    # chose for Llama-3.1-70B on 128 devices (one 128-token sequence each) to keep the MLP
    # weights split and replicate the batch instead: [16384, 28672] buffers of the global
    # batch on every device, and 5x the compile time. With checkpointed regions the gather is
    # placed where each op reads a weight, so that a recomputation gathers again from the
    # fenced stored weight; without them once at the top, which compiles faster (70B plan:
    # XLA compile 76 s vs 131 s, same memory within 2.5 %).
    at_use = None
    if spmd and _has_checkpointed_regions(grad_gm):
        at_use = {i: functools.partial(pin, sharding=c)
                  for i, c in enumerate(shardings.compute_params)}

    def program(param_flat, state_flat, consts, batch, scalars_in, key=None):
        params = [a.reshape(s) for a, s in zip(param_flat, param_shapes)]
        if spmd:
            params = [pin(p, s) for p, s in zip(params, shardings.params)]
        if spmd and at_use is None:  # gathered once, at the top
            params = [pin(p, c) for p, c in zip(params, shardings.compute_params)]
        if k == 1:
            grads, loss, weight, new_consts = gradients(params, list(consts), list(batch), key)
            grads, loss = normalise(grads, loss, weight)
        else:
            grads, loss, new_consts = accumulate(params, list(consts), list(batch), key)
        if spmd:
            grads = [pin(g, s) for g, s in zip(grads, shardings.params)]
            states = [pin(a.reshape(s), sh) for a, s, sh in
                      zip(state_flat, state_shapes, shardings.states)]
            outputs, _ = interpreter.run_graph(
                update_gm, params + list(grads) + states + [scalars_in])
            # Back to the flat storage layout (the out_shardings say how it is split).
            outputs = [o.reshape(-1) for o in outputs[:-1]] + [outputs[-1]]
        else:
            flat_grads = [g.reshape(-1) for g in grads]
            outputs, _ = interpreter.run_graph(
                update_gm, list(param_flat) + flat_grads + list(state_flat) + [scalars_in])
        return (outputs[:n_params], outputs[n_params:-1], [new_consts[p] for p in mutated],
                loss, outputs[-1], scalars_in[0, 0])

    donate = (0, 1) if step.donate else ()
    key_dtype = jax.random.key(0).dtype
    if not spmd:
        jitted = jax.jit(program, donate_argnums=donate)
        args = [values["params"], values["states"], values["consts"], values["batch"],
                jax.device_put(scalars, device)]
        if random:
            args.append(jax.ShapeDtypeStruct(
                (), key_dtype, sharding=jax.sharding.SingleDeviceSharding(device)))
        in_shardings = None
    else:
        rep = shardings.replicated
        in_shardings = [flat_params, flat_states, list(shardings.consts), list(shardings.batch),
                        rep] + ([rep] if random else [])
        out_shardings = (flat_params, flat_states, [rep] * len(mutated), rep, rep, rep)
        jitted = jax.jit(program, in_shardings=tuple(in_shardings),
                         out_shardings=out_shardings, donate_argnums=donate)

        def abstract(shape, dtype, sharding):
            return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)

        def described(tensors, shapes, group_shardings):
            return [abstract(shape, storage_dtype(t.dtype), s)
                    for t, shape, s in zip(tensors, shapes, group_shardings)]

        # Only shapes, dtypes and shardings: nothing is allocated to lower and compile.
        args = [described(st.params, [(p.numel(),) for p in st.params], flat_params),
                described(st.states, [(t.numel(),) for t in st.states], flat_states),
                described(st.consts, [tuple(c.shape) for c in st.consts], shardings.consts),
                described(st.batch_leaves, [tuple(b.shape) for b in st.batch_leaves],
                          shardings.batch),
                abstract(scalars.shape, jnp.float32, rep)]
        if random:
            args.append(abstract((), key_dtype, rep))
    lowered = stages.time("lower", jitted.lower, *args)
    executable = stages.time("compile", compile_lowered, lowered,
                             _platform(device, mesh)) if compile else None
    if spmd and executable is not None:
        executable = _PlacingExecutable(executable, in_shardings)
    return Program(executable, random, mutated, grad_norm_dtype, grad_gm, update_gm,
                   lowered=lowered, in_shardings=in_shardings)
