"""Build the XLA program of one training step from its two traced graphs.

``program(params, states, consts, batch, scalars, layer_indices[, key])`` takes the parameters
and optimizer state as flat buffers (exactly the ``tpu`` storages' buffers, so donation lets
XLA update them in place) and ``layer_indices`` (int32 scalars ``0 .. N-1`` for a model whose
layers run under ``lax.scan``: :func:`tpu_train.compile.layer_scan.layer_indices`), and returns
the new flat buffers, the new values of mutated buffers, and the loss, gradient norm and
learning rate. With ``skip_non_finite`` (a field of the step) it also
returns a ``finite`` flag (loss and gradient norm both finite), and when the flag is false the
"new" parameters, optimizer state and mutated buffers are the old ones (``jnp.where`` in the
same program: a non-finite update never leaves it). Gradient accumulation runs the gradient graph under
``lax.scan`` over micro-batches: program size and compile time do not grow with the number of
micro-batches.

SPMD (``mesh`` and ``plan`` given): the program is jitted with ``in_shardings`` /
``out_shardings`` from :func:`tpu_train.compile.spmd.step_shardings`. The ``tpu`` storages stay flat
(the device layer's invariant), so each parameter / state buffer is a flat *global* array split
over the same mesh axes as its plan spec (:func:`tpu_train.compile.spmd.flat_storage_sharding`):
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
import numpy
import torch

from tpu_train.compile import (interpreter, layer_groups, layer_scan, loss_graph, shared_layers,
                               tracing)
from tpu_train.compile.checkpointing import OPTIMIZATION_BARRIER
from tpu_train.compile.spmd import (PlacingExecutable, activation_constraint, flat_storage_sharding,
                                    step_shardings)
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
    seconds: dict = dataclasses.field(default_factory=dict)  # trace / lower / compile (if timed)
    layer_indices: int = 0  # how many int32 layer-index scalars the program takes
    # "jax": JAX differentiates the traced forward (grad_graph is then the loss graph);
    # "torch": PyTorch's backward was traced. autodiff_note says why not "jax", if not.
    autodiff: str = "torch"
    autodiff_note: str = ""

    def layer_index_values(self, device) -> list:
        """The ``layer_indices`` argument: ``j`` at position ``j`` (made once per placement)."""
        if not self.layer_indices:
            return []
        placement = device if self.in_shardings is None \
            else self.in_shardings[_LAYER_INDEX_ARGUMENT][0]
        return list(_layer_index_values(self.layer_indices, placement))

    def analysis(self) -> dict[str, Any]:
        """XLA's per-device memory and cost figures of the compiled program
        (:func:`compiled_analysis`)."""
        if self.executable is None:
            raise ValueError("the program was lowered with compile=False: nothing to analyse")
        return compiled_analysis(self.executable)


def compiled_analysis(compiled) -> dict[str, Any]:
    """XLA's per-device memory and cost of a compiled program (``jax.stages.Compiled``).

    ``bytes_peak_estimate`` is arguments + temporaries + outputs that do not alias a donated
    argument: what one device must hold at once.
    """
    mem = compiled.memory_analysis()
    out: dict[str, Any] = {}
    if mem is not None:
        for key in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                    "temp_size_in_bytes", "generated_code_size_in_bytes"):
            out[key] = int(getattr(mem, key, 0) or 0)
        out["bytes_peak_estimate"] = (out["argument_size_in_bytes"] + out["temp_size_in_bytes"]
                                      + out["output_size_in_bytes"] - out["alias_size_in_bytes"])
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # one dict per computation on some backends
        cost = cost[0] if cost else {}
    cost = cost or {}
    out["flops_per_device"] = float(cost.get("flops", 0.0))
    out["bytes_accessed_per_device"] = float(cost.get("bytes accessed", 0.0))
    return out


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


def _state_owners(st) -> list[int]:
    """For each optimizer-state tensor, the index of the parameter it belongs to."""
    owners = []
    for i, count in enumerate(st.state_counts):
        owners.extend([i] * count)
    return owners


def _has_checkpointed_regions(gm: torch.fx.GraphModule) -> bool:
    return any(node.target is OPTIMIZATION_BARRIER for node in gm.graph.nodes)


def _has_layer_scans(gm: torch.fx.GraphModule) -> bool:
    """Scanned layer stacks gather each layer's weights inside the loop (at use): gathered
    once at the top, every layer's full weights would be stacked."""
    return any(node.target is layer_scan.LAYER_SCAN for node in gm.graph.nodes)


def _key_dtype():
    """The dtype of a typed PRNG key (the program's optional last argument)."""
    return jax.random.key(0).dtype


# The program's arguments: params, states, consts, batch, scalars, layer indices[, key].
_LAYER_INDEX_ARGUMENT = 5


@functools.lru_cache(maxsize=None)
def _layer_index_values(count: int, placement) -> tuple:
    return tuple(jax.device_put(numpy.int32(j), placement) for j in range(count))


def _abstract_inputs(st, scalars, random: bool, params, states, consts, batch, scalar,
                     layer_indices: int) -> list:
    """The step's arguments as shapes, dtypes and the given shardings only: nothing is
    allocated to lower and compile. Parameters and states go in as their flat storages."""

    def described(tensors, shapes, shardings):
        return [jax.ShapeDtypeStruct(tuple(shape), storage_dtype(t.dtype), sharding=s)
                for t, shape, s in zip(tensors, shapes, shardings)]

    args = [described(st.params, [(p.numel(),) for p in st.params], params),
            described(st.states, [(t.numel(),) for t in st.states], states),
            described(st.consts, [tuple(c.shape) for c in st.consts], consts),
            described(st.batch_leaves, [tuple(b.shape) for b in st.batch_leaves], batch),
            jax.ShapeDtypeStruct(tuple(scalars.shape), jnp.float32, sharding=scalar),
            [jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar)] * layer_indices]
    if random:
        args.append(jax.ShapeDtypeStruct((), _key_dtype(), sharding=scalar))
    return args


@dataclasses.dataclass
class _GradientTrace:
    """What :func:`_trace_gradients` traced: the loss graph for JAX to differentiate (``note``
    empty), or PyTorch's gradient graph and why (``note``; ``model_fallback``: the error by
    which the model's own use of autograd ended the forward's trace, which the compile log
    names)."""

    gm: torch.fx.GraphModule
    weighted: bool
    note: str = ""
    model_fallback: str = ""


def _trace_gradients(step, st, fakes, param_fakes, const_fakes, batch_fakes,
                     autodiff: str) -> _GradientTrace:
    args = (step.model, step.loss_fn, st.param_names, st.const_names, st.batch_spec, fakes,
            param_fakes, const_fakes, batch_fakes)
    scan_layers = getattr(step, "scan_layers", None)
    least = layer_groups.min_scanned_layers(scan_layers)
    model_fallback = ""
    if autodiff != "jax":
        note = "autodiff='torch'"
    elif least is not None and layer_groups.find_groups(step.model, least):
        note = "scanned layers are differentiated by their own scan"
    else:
        try:
            return _GradientTrace(*loss_graph.trace_loss_graph(*args))
        except Exception as error:  # noqa: BLE001
            # TorchAutogradNeeded, or what torch.func refuses in a forward-only trace: a
            # forward that writes a buffer (BatchNorm's running statistics) writes a tensor
            # the vjp captured. PyTorch's gradient graph handles both; an error in the user's
            # code is raised by that trace as before.
            model_fallback = f"{type(error).__name__}: {error}".splitlines()[0]
            note = "the forward uses autograd itself: " + model_fallback
    gm, weighted = layer_groups.traced_with_groups(
        step.model, lambda: tracing.trace_grad_graph(*args), scan_layers)
    return _GradientTrace(gm, weighted, note, model_fallback)


def _differentiated_loss_graph(loss_gm, params, consts, batch, key, *, constrain, at_use):
    """``(grads, loss, weight, new consts)`` of the loss graph, by ``jax.grad``."""
    n_params = len(params)

    def loss_and_rest(diff):
        (loss, weight), mutations = interpreter.run_graph(
            loss_gm, list(diff) + consts + batch, rng_key=key, constrain=constrain,
            at_use=at_use)
        return loss, (loss.astype(jnp.float32), weight, mutations)

    grads, (loss, weight, mutations) = jax.grad(loss_and_rest, has_aux=True)(list(params))
    new_consts = [mutations.get(n_params + i, c) for i, c in enumerate(consts)]
    return list(grads), loss, weight, new_consts


def build_program(step, st, values, scalars, device, stages, *, mesh=None, plan=None,
                  compile: bool = True, autodiff: str | None = None) -> Program:
    """Trace, lower and compile the step for the tensors in ``st`` (see ``train_step``).

    ``step`` has the fields of :class:`tpu_train.compile.lowering.StepDefinition`.
    ``mesh`` and ``plan`` (both or neither) compile an SPMD program (module docstring).
    ``values`` may be None: inputs are then described from ``st``'s shapes and dtypes alone
    (on ``device`` without a mesh). ``compile=False`` stops after lowering
    (``Program.executable`` is then None). ``autodiff`` overrides the step's.
    """
    if (mesh is None) != (plan is None):
        raise ValueError("an SPMD step needs both mesh= and plan= (got only "
                         f"{'mesh' if plan is None else 'plan'})")
    spmd = mesh is not None
    fakes = tracing.FakeFactory()
    k = step.grad_accum_steps
    # Tracing happens on the tpu device whatever the tensors are (a planner's model lives on
    # ``meta``); where the program runs comes from ``device`` or the mesh.
    first = st.params[0].device
    tpu_device = first if first.type == "tpu" else torch.device("tpu", 0)

    def fake(t, shape=None):
        return fakes.like(t.shape if shape is None else shape, t.dtype, tpu_device)

    param_fakes = [fake(p) for p in st.params]
    const_fakes = [fake(c) for c in st.consts]
    batch_fakes = [fake(b, (b.shape[0] // k,) + tuple(b.shape[1:])) for b in st.batch_leaves]
    traced = stages.time(
        "trace", _trace_gradients, step, st, fakes, param_fakes, const_fakes, batch_fakes,
        autodiff or getattr(step, "autodiff", "jax"))
    grad_gm, weighted, autodiff_note = traced.gm, traced.weighted, traced.note
    jax_autodiff = not autodiff_note
    stages.autodiff_fallback = traced.model_fallback
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
    stages.scanned_layers = layer_scan.scanned_layer_count(grad_gm)
    stages.shared_layer_calls = shared_layers.called_layers(grad_gm)
    n_indices = layer_scan.largest_stack(grad_gm)

    n_params, n_consts = len(st.params), len(st.consts)
    mutated = tuple(i - n_params for i in _mutated_placeholders(grad_gm)
                    if n_params <= i < n_params + n_consts)
    random = _has_random_ops(grad_gm)
    param_shapes = [tuple(p.shape) for p in st.params]
    grad_norm_node = [n for n in update_gm.graph.nodes if n.op == "output"][0].args[0][-1]
    grad_norm_dtype = grad_norm_node.meta["val"].dtype

    constrain = activation_constraint(plan, mesh, step.model, batch_fakes) if spmd else None
    skip = bool(getattr(step, "skip_non_finite", False))

    def gradients(params, consts, batch, key):
        if jax_autodiff:
            return _differentiated_loss_graph(grad_gm, params, consts, batch, key,
                                              constrain=constrain, at_use=at_use)
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
        shardings = step_shardings(
            plan, mesh, param_names=st.param_names, param_shapes=param_shapes,
            state_owners=_state_owners(st), state_shapes=state_shapes, num_consts=n_consts,
            batch_shapes=[tuple(b.shape) for b in st.batch_leaves])
        flat_params = [flat_storage_sharding(s) for s in shardings.params]
        flat_states = [flat_storage_sharding(s) for s in shardings.states]

    def pin(value, sharding):
        return jax.lax.with_sharding_constraint(value, sharding)

    # Weights are stored on the plan's layout and used on its compute layout: FSDP's
    # all-gather made explicit (spmd.compute_sharding). Left to sharding propagation, XLA
    # chose for Llama-3.1-70B on 128 devices (one 128-token sequence each) to keep the MLP
    # weights split and replicate the batch instead: [16384, 28672] buffers of the global
    # batch on every device, and 5x the compile time. With checkpointed regions the gather is
    # placed where each op reads a weight, so that a recomputation gathers again from the
    # fenced stored weight; without them once at the top, which compiles faster (70B plan:
    # XLA compile 76 s vs 131 s, same memory within 2.5 %).
    at_use = None
    if spmd and (_has_checkpointed_regions(grad_gm) or _has_layer_scans(grad_gm)):
        at_use = {i: functools.partial(pin, sharding=c)
                  for i, c in enumerate(shardings.compute_params)}

    def program(param_flat, state_flat, consts, batch, scalars_in, layer_index, key=None):
        with layer_scan.layer_indices(layer_index):
            return train_step(param_flat, state_flat, consts, batch, scalars_in, key)

    def train_step(param_flat, state_flat, consts, batch, scalars_in, key):
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
            update_in = (params, list(grads), states)
        else:
            update_in = (list(param_flat), [g.reshape(-1) for g in grads], list(state_flat))

        def update(operands):
            p, g, s = operands
            outputs, _ = interpreter.run_graph(update_gm, p + g + s + [scalars_in])
            return outputs[:n_params], outputs[n_params:-1], outputs[-1]

        changed = [new_consts[p] for p in mutated]
        if not skip:
            new_params, new_states, grad_norm = update(update_in)
        else:
            # The gradient norm decides; only it is kept from this run of the update graph
            # (XLA drops the rest). The update itself runs in a conditional, so that a skipped
            # step passes the donated buffers through: selecting between new and old values
            # instead would make XLA copy every optimizer state before the update overwrites it.
            grad_norm = update(update_in)[2]
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            new_params, new_states = jax.lax.cond(
                finite, lambda operands: update(operands)[:2],
                lambda operands: (operands[0], operands[2]), update_in)
            changed = [jnp.where(finite, n, consts[p]) for n, p in zip(changed, mutated)]
        if spmd:  # back to the flat storage layout (the out_shardings say how it is split)
            new_params = [o.reshape(-1) for o in new_params]
            new_states = [o.reshape(-1) for o in new_states]
        result = (new_params, new_states, changed, loss, grad_norm, scalars_in[0, 0])
        return result + (finite,) if skip else result

    donate = (0, 1) if step.donate else ()
    if not spmd:
        jitted = jax.jit(program, donate_argnums=donate)
        in_shardings = None
        one = jax.sharding.SingleDeviceSharding(device)
        if values is None:
            args = _abstract_inputs(st, scalars, random, [one] * len(st.params),
                                    [one] * len(st.states), [one] * n_consts,
                                    [one] * len(st.batch_leaves), one, n_indices)
        else:
            args = [values["params"], values["states"], values["consts"], values["batch"],
                    jax.device_put(scalars, device), list(_layer_index_values(n_indices, device))]
            if random:
                args.append(jax.ShapeDtypeStruct((), _key_dtype(), sharding=one))
    else:
        rep = shardings.replicated
        in_shardings = [flat_params, flat_states, list(shardings.consts), list(shardings.batch),
                        rep, [rep] * n_indices] + ([rep] if random else [])
        out_shardings = (flat_params, flat_states, [rep] * len(mutated), rep, rep, rep) \
            + ((rep,) if skip else ())
        jitted = jax.jit(program, in_shardings=tuple(in_shardings),
                         out_shardings=out_shardings, donate_argnums=donate)
        args = _abstract_inputs(st, scalars, random, flat_params, flat_states, shardings.consts,
                                shardings.batch, rep, n_indices)
    try:
        lowered = stages.time("lower", jitted.lower, *args)
    except Exception as error:  # noqa: BLE001
        if not jax_autodiff:
            raise
        # A lowering JAX cannot differentiate (a reverse-mode while_loop, a variadic
        # reduction): PyTorch's backward formulas are traced instead.
        program = build_program(step, st, values, scalars, device, stages, mesh=mesh,
                                plan=plan, compile=compile, autodiff="torch")
        program.autodiff_note = "JAX could not differentiate the loss graph: " + \
            f"{type(error).__name__}: {error}".splitlines()[0]
        stages.autodiff_fallback = program.autodiff_note
        return program
    executable = stages.time("compile", lowered.compile) if compile else None
    if spmd and executable is not None:
        executable = PlacingExecutable(executable, in_shardings)
    return Program(executable, random, mutated, grad_norm_dtype, grad_gm, update_gm,
                   lowered=lowered, in_shardings=in_shardings, layer_indices=n_indices,
                   autodiff="jax" if jax_autodiff else "torch", autodiff_note=autodiff_note)
