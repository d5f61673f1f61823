"""Build the XLA program of one training step from its two traced graphs.

``program(params, states, consts, batch, scalars, layer_indices[, key])`` takes the parameters
and optimizer state as flat buffers (exactly the ``tpu`` storages' buffers, so donation lets
XLA update them in place) and ``layer_indices`` (int32 scalars ``0 .. N-1`` for a model whose
layers run under ``lax.scan``: :func:`tpu_train.compile.layer_scan.layer_indices`), and returns
the new flat buffers, the new values of mutated buffers, and the step's metrics as one float32
vector, ``[loss, gradient norm, learning rate]`` (:data:`METRICS`; a gradient norm of another
dtype also leaves on its own). With ``skip_non_finite`` (a field of the step) the vector ends
with a ``finite`` flag (1.0 where loss and gradient norm are both finite), and where it is 0.0
the "new" parameters, optimizer state and mutated buffers are the old ones (``jnp.where`` in the
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

import contextlib
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy
import torch

from tpu_train.compile import (context_parallel, interpreter, layer_scan, loss_graph, memory_errors,
                               shared_layers, stacked_layers)
from tpu_train.compile.remat_regions import OPTIMIZATION_BARRIER
from tpu_train.compile.spmd import (BATCH_AXES, PlacingExecutable, activation_constraint,
                                    flat_storage_sharding, step_shardings)
from tpu_train.compile.step_trace import TracedStep, trace_step
from tpu_train.device import runtime
from tpu_train.ops import attention_tpu
from tpu_train.ops.dtypes import storage_dtype

aten = torch.ops.aten


# The positions in the program's metrics vector; FINITE only with skip_non_finite. One vector
# is one device-to-host transfer a step, which the step waits for: on a TPU each transfer is a
# DMA and a delinearization of its own (docs/benchmarks.md, "a twelfth pass").
METRICS = {"loss": 0, "grad_norm": 1, "lr": 2}
FINITE = 3


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
    compiler_options: dict | None = None  # the XLA options it is (to be) compiled with
    # Which parameters and states go in and out stacked (None: every one on its own).
    stacking: stacked_layers.StackLayout | None = None

    def layer_index_values(self, device) -> list:
        """The ``layer_indices`` argument: ``j`` at position ``j`` (made once per placement)."""
        if not self.layer_indices:
            return []
        placement = device if self.in_shardings is None \
            else self.in_shardings[_LAYER_INDEX_ARGUMENT][0]
        return list(_layer_index_values(self.layer_indices, placement))

    def scalars_placement(self, device) -> Any:
        """The sharding the host-scalars argument is read with: on ``device``, or the SPMD
        program's own."""
        if self.in_shardings is None:
            return jax.sharding.SingleDeviceSharding(device)
        return self.in_shardings[_SCALARS_ARGUMENT]

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
                    "temp_size_in_bytes", "generated_code_size_in_bytes",
                    "host_temp_size_in_bytes"):
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


def _state_owners(st) -> list[int]:
    """For each optimizer-state tensor, the index of the parameter it belongs to."""
    owners = []
    for i, count in enumerate(st.state_counts):
        owners.extend([i] * count)
    return owners


def _has_checkpointed_regions(gm: torch.fx.GraphModule) -> bool:
    return any(node.target is OPTIMIZATION_BARRIER for node in gm.graph.nodes) \
        or shared_layers.has_remat_calls(gm)


def _has_layer_scans(gm: torch.fx.GraphModule) -> bool:
    """Scanned layer stacks gather each layer's weights inside the loop (at use): gathered
    once at the top, every layer's full weights would be stacked."""
    return any(node.target is layer_scan.LAYER_SCAN for node in gm.graph.nodes)


def _key_dtype():
    """The dtype of a typed PRNG key (the program's optional last argument)."""
    return jax.random.key(0).dtype


def _cast_for_compute(params: list, compute, gathered: frozenset = frozenset()) -> list:
    """JAX arrays cast to the compute dtype (a jnp dtype or None) where floating, except the
    ``gathered`` positions (:func:`.loss_graph.gathered_parameters`): the graph casts the
    rows it gathers from them."""
    if compute is None:
        return list(params)
    return stacked_layers.lift(params, lambda i, p: p.astype(compute) if jnp.issubdtype(
        p.dtype, jnp.floating) and p.dtype != compute and i not in gathered else p)


def natural_layout(platform: str) -> bool:
    """Do a single-device step's parameters and optimizer state enter and leave the program
    in their natural shapes (True), or as their storages' flat buffers (False)?

    As the device layer keeps whole-tensor buffers on ``platform``
    (:func:`tpu_train.device.runtime.natural_buffers`): flat on the CPU client, where the
    update traced on flat tensors reads and writes the donated buffers in place (traced on
    2-D shapes, XLA:CPU copied every parameter and state buffer once per step); natural on a
    TPU, where a flat <-> 2-D reshape is a copy and the weight gradients' dots can feed the
    update directly. The storages keep what the step returns (:meth:`Storage.shaped`)."""
    return runtime.natural_buffers(platform)


def skips_by_select(platform: str) -> bool:
    """Does ``skip_non_finite`` keep the old values by selecting between old and new (True),
    or by running the update in a ``lax.cond`` that passes the old buffers through (False)?

    A conditional on the CPU client: there the select made XLA copy every optimizer state
    before the update overwrote it (debug_tiny 16 x 128: 138 -> 60 copies, temporaries 256.5
    -> 231.5 MiB with the conditional). A select elsewhere: XLA's TPU compiler fuses it into
    the update's elementwise fusions, which read the old values anyway, while a conditional is
    a boundary it does not fuse or schedule across; W1 bf16 compiled for a v5e, bytes accessed
    by the cost analysis without memory-space prefetches (``xla_msa_enable=false``): 1.868 GB
    with the conditional, 1.698 GB with the select, the same as without skipping."""
    return platform != "cpu"


# The program's arguments: params, states, consts, batch, scalars, layer indices[, key].
_SCALARS_ARGUMENT = 4
_LAYER_INDEX_ARGUMENT = 5


@functools.lru_cache(maxsize=None)
def _layer_index_values(count: int, placement) -> tuple:
    return tuple(jax.device_put(numpy.int32(j), placement) for j in range(count))


def _abstract_inputs(st, scalars, random: bool, params, states, consts, batch, scalar,
                     layer_indices: int, natural: bool = False, stacking=None) -> list:
    """The step's arguments as shapes, dtypes and the given shardings only: nothing is
    allocated to lower and compile. Parameters and states go in as their flat storages, or
    in their natural shapes (:func:`natural_layout`); with ``stacking`` (a
    :class:`.stacked_layers.StackLayout`) a stacked slot as one ``[L, ...]`` array."""

    def described(tensors, shapes, shardings):
        return [jax.ShapeDtypeStruct(tuple(shape), storage_dtype(t.dtype), sharding=s)
                for t, shape, s in zip(tensors, shapes, shardings)]

    def layout(t):
        return tuple(t.shape) if natural else (t.numel(),)

    param_args = described(st.params, [layout(p) for p in st.params], params)
    state_args = described(st.states, [layout(t) for t in st.states], states)
    if stacking is not None:
        param_args, state_args = stacking.structs(param_args), stacking.structs(state_args, True)
    args = [param_args, state_args,
            described(st.consts, [tuple(c.shape) for c in st.consts], consts),
            described(st.batch_leaves, [tuple(b.shape) for b in st.batch_leaves], batch),
            jax.ShapeDtypeStruct(tuple(scalars.shape), jnp.float32, sharding=scalar),
            [jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar)] * layer_indices]
    if random:
        args.append(jax.ShapeDtypeStruct((), _key_dtype(), sharding=scalar))
    return args


def _gathered_tables(gm, n_params: int, at_use) -> frozenset:
    """The parameters :func:`_cast_for_compute` leaves to the graph's gathers; none with
    at-use gathers (SPMD), where a table is cast before its all-gather (half the bytes)."""
    return frozenset() if at_use is not None else loss_graph.gathered_parameters(gm, n_params)


def _differentiated_loss_graph(loss_gm, params, consts, batch, key, *, constrain, at_use,
                               compute=None):
    """``(grads, loss, weight, new consts)`` of the loss graph, by ``jax.grad``; the
    parameters are cast to ``compute`` (a jnp dtype) inside, so their gradients come back in
    the parameters' own dtype."""
    n_params = len(params)
    gathered = _gathered_tables(loss_gm, n_params, at_use)

    def loss_and_rest(diff):
        (loss, weight), mutations = interpreter.run_graph(
            loss_gm, _cast_for_compute(diff, compute, gathered) + consts + batch, rng_key=key,
            constrain=constrain, at_use=at_use)
        return loss, (loss.astype(jnp.float32), weight, mutations)

    grads, (loss, weight, mutations) = jax.grad(loss_and_rest, has_aux=True)(list(params))
    new_consts = [mutations.get(n_params + i, c) for i, c in enumerate(consts)]
    return list(grads), loss, weight, new_consts


@dataclasses.dataclass
class _SpmdLayout:
    """Where the SPMD program's values live (:func:`tpu_train.compile.spmd.step_shardings`)."""

    shardings: Any
    flat_params: list  # each parameter's flat storage, split like its plan spec
    flat_states: list
    constrain: Any  # the activation sharding constraint
    at_use: dict | None  # parameter index -> pin to its compute layout where an op reads it


def _spmd_layout(step, st, plan, mesh, traced: TracedStep) -> _SpmdLayout:
    shardings = step_shardings(
        plan, mesh, param_names=st.param_names, param_shapes=[tuple(p.shape) for p in st.params],
        state_owners=_state_owners(st), state_shapes=[tuple(t.shape) for t in st.states],
        num_consts=len(st.consts), batch_shapes=[tuple(b.shape) for b in st.batch_leaves])
    # Weights are stored on the plan's layout and used on its compute layout: FSDP's
    # all-gather made explicit (spmd.compute_sharding). Left to sharding propagation, XLA
    # chose for Llama-3.1-70B on 128 devices (one 128-token sequence each) to keep the MLP
    # weights split and replicate the batch instead: [16384, 28672] buffers of the global
    # batch on every device, and 5x the compile time. With checkpointed regions the gather is
    # placed where each op reads a weight, so that a recomputation gathers again from the
    # fenced stored weight; without them once at the top, which compiles faster (70B plan:
    # XLA compile 76 s vs 131 s, same memory within 2.5 %).
    # The read first pins the weight to its stored layout: where JAX differentiates the read
    # (a recomputed layer's call), the gradient is then reduce-scattered in that layer's
    # backward instead of staying whole until the step's end (measured: one gathered layer
    # more per layer, tests/parallel/test_compiled_spmd.py).
    at_use = None
    if _has_checkpointed_regions(traced.grad_gm) or _has_layer_scans(traced.grad_gm):
        at_use = {i: functools.partial(_pin_at_use, stored=s, compute=c)
                  for i, (s, c) in enumerate(zip(shardings.params, shardings.compute_params))}
    return _SpmdLayout(shardings, [flat_storage_sharding(s) for s in shardings.params],
                       [flat_storage_sharding(s) for s in shardings.states],
                       activation_constraint(plan, mesh, step.model, traced.batch_fakes), at_use)


def _pin(value, sharding):
    return jax.lax.with_sharding_constraint(value, sharding)


def _pin_at_use(value, stored, compute):
    return _pin(_pin(value, stored), compute)


class _StepFunction:
    """The step as a JAX function of flat buffers: gradients (one batch, or a scan over
    micro-batches), then the optimizer update; the program's body (module docstring)."""

    def __init__(self, step, st, traced: TracedStep, layout: _SpmdLayout | None,
                 natural: bool, platform: str, whole: tuple):
        self.traced, self.layout, self.natural = traced, layout, natural
        # A scanned stack's slots go in and out stacked (one device; an SPMD step's
        # parameters keep their own arrays, each split by the plan).
        self.stacking = None if layout is not None else stacked_layers.plan_stacks(
            traced.grad_gm, len(st.params), st.state_counts,
            [(tuple(t.shape), t.dtype) for t in st.states], whole)
        self.k = step.settings.grad_accum_steps
        self.skip = step.settings.skip_non_finite
        self.own_norm = traced.grad_norm_dtype != torch.float32
        self.skip_by_select = skips_by_select(platform)
        self.n_params, self.n_consts = len(st.params), len(st.consts)
        self.param_shapes = [tuple(p.shape) for p in st.params]
        self.state_shapes = [tuple(t.shape) for t in st.states]
        self.batch_shapes = [tuple(b.shape) for b in st.batch_leaves]
        compute = step.settings.compute_dtype
        self.compute = None if compute is None else storage_dtype(compute)

    def packed(self, values, states: bool = False) -> list:
        """Per-tensor values as the program passes them (stacked slots stacked)."""
        return list(values) if self.stacking is None else self.stacking.pack(values, states)

    def expanded(self, values, states: bool = False) -> list:
        """The program's values per tensor (a stacked slot's layers as its views)."""
        return list(values) if self.stacking is None else self.stacking.expand(values, states)

    def __call__(self, param_flat, state_flat, consts, batch, scalars_in, key):
        with stacked_layers.views():
            return self._step(self.expanded(param_flat), self.expanded(state_flat, True),
                              consts, batch, scalars_in, key)

    def _step(self, param_flat, state_flat, consts, batch, scalars_in, key):
        traced, layout, mutated = self.traced, self.layout, self.traced.mutated
        # A tpu batch tensor comes as its storage is kept (flat): reshaped here, not by a
        # program of its own before each call.
        batch = [b if tuple(b.shape) == s else b.reshape(s)
                 for b, s in zip(batch, self.batch_shapes)]
        shapes = self.param_shapes
        params = stacked_layers.lift(param_flat, lambda i, a: a.reshape(shapes[i]))
        if layout is not None:
            params = [_pin(p, s) for p, s in zip(params, layout.shardings.params)]
            if layout.at_use is None:  # gathered once, at the top
                params = [_pin(p, c) for p, c in zip(params, layout.shardings.compute_params)]
        if self.k == 1:
            grads, loss, weight, new_consts = self.gradients(params, list(consts), list(batch),
                                                             key)
            grads, loss = self.normalise(grads, loss, weight)
        else:
            grads, loss, new_consts = self.accumulate(params, list(consts), list(batch), key)
        if layout is not None:
            grads = [_pin(g, s) for g, s in zip(grads, layout.shardings.params)]
            states = [_pin(a.reshape(s), sh) for a, s, sh in
                      zip(state_flat, self.state_shapes, layout.shardings.states)]
            update_in = (params, list(grads), states)
        elif self.natural:
            update_in = (params, list(grads), list(state_flat))
        else:
            update_in = (list(param_flat), stacked_layers.lift(grads, lambda i, g: g.reshape(-1)),
                         list(state_flat))
        changed = [new_consts[p] for p in mutated]
        # The update's operands and results as the program passes them (stacked slots
        # stacked), so that a conditional's branches get whole stacks too.
        packed_in = (self.packed(update_in[0]), self.packed(update_in[1]),
                     self.packed(update_in[2], True))

        def update(operands):
            p, g, s = self.expanded(operands[0]), self.expanded(operands[1]), \
                self.expanded(operands[2], True)
            outputs, _ = interpreter.run_graph(traced.update_gm, p + g + s + [scalars_in])
            return (self.packed(outputs[:self.n_params]),
                    self.packed(outputs[self.n_params:-1], True), outputs[-1])

        if not self.skip:
            new_params, new_states, grad_norm = update(packed_in)
        elif self.skip_by_select:
            new_params, new_states, grad_norm = update(packed_in)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            new_params = [jnp.where(finite, n, o) for n, o in zip(new_params, packed_in[0])]
            new_states = [jnp.where(finite, n, o) for n, o in zip(new_states, packed_in[2])]
            changed = [jnp.where(finite, n, consts[p]) for n, p in zip(changed, mutated)]
        else:
            # The gradient norm decides; only it is kept from this run of the update graph
            # (XLA drops the rest). The update itself runs in a conditional, so that a skipped
            # step passes the donated buffers through (skips_by_select).
            grad_norm = update(packed_in)[2]
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

            def applied(operands):
                with stacked_layers.views():
                    return update(operands)[:2]

            new_params, new_states = jax.lax.cond(
                finite, applied, lambda operands: (operands[0], operands[2]), packed_in)
            changed = [jnp.where(finite, n, consts[p]) for n, p in zip(changed, mutated)]
        if layout is not None:  # back to the flat storage layout (the out_shardings split it)
            new_params = [o.reshape(-1) for o in new_params]
            new_states = [o.reshape(-1) for o in new_states]
        metrics = [loss, grad_norm, scalars_in[0, 0]] + ([finite] if self.skip else [])
        result = (new_params, new_states, changed,
                  jnp.stack([m.astype(jnp.float32) for m in metrics]))
        return result + (grad_norm.reshape(1),) if self.own_norm else result

    def gradients(self, params, consts, batch, key):
        """``(grads, loss, weight, new consts)`` of one (micro-)batch."""
        traced = self.traced
        constrain = None if self.layout is None else self.layout.constrain
        at_use = None if self.layout is None else self.layout.at_use
        if traced.jax_autodiff:
            return _differentiated_loss_graph(traced.grad_gm, params, consts, batch, key,
                                              constrain=constrain, at_use=at_use,
                                              compute=self.compute)
        outputs, mutations = interpreter.run_graph(
            traced.grad_gm, _cast_for_compute(
                params, self.compute, _gathered_tables(traced.grad_gm, len(params), at_use))
            + consts + batch,
            rng_key=key, constrain=constrain, at_use=at_use)
        new_consts = [mutations.get(self.n_params + i, consts[i]) for i in range(self.n_consts)]
        grads = stacked_layers.lift(outputs[:-2], lambda i, g: g.astype(params[i].dtype))
        return grads, outputs[-2], outputs[-1], new_consts

    def normalise(self, grads, loss, total):
        # Plain losses: the mean over micro-batches. (loss_sum, count) losses: sums over the
        # total count, so every counted item weighs the same (an empty step divides by 1).
        k = self.k
        if not self.traced.weighted:
            if k == 1:
                return list(grads), loss
            return stacked_layers.lift(grads, lambda i, g: (g / k).astype(g.dtype)), loss / k
        total = jnp.where(total > 0, total, 1.0)
        return stacked_layers.lift(
            grads, lambda i, g: (g / total.astype(g.dtype)).astype(g.dtype)), loss / total

    def accumulate(self, params, consts, batch, key):
        """Gradients summed over ``k`` micro-batches by ``lax.scan``, then normalised."""
        k, mutated = self.k, self.traced.mutated
        micro = [b.reshape((k, b.shape[0] // k) + b.shape[1:]) for b in batch]

        def body(carry, xs):
            grad_sum, loss_sum, weight_sum, carried = carry
            micro_batch, i = xs
            current = list(consts)
            for position, value in zip(mutated, carried):
                current[position] = value
            micro_key = None if key is None else jax.random.fold_in(key, i)
            grads, loss, weight, new_consts = self.gradients(params, current,
                                                             list(micro_batch), micro_key)
            # Summed as the program passes them: a stacked slot's gradients as one array.
            grad_sum = [a + g.astype(a.dtype) for a, g in zip(grad_sum, self.packed(grads))]
            return (grad_sum, loss_sum + loss, weight_sum + weight,
                    [new_consts[p] for p in mutated]), None

        init = (self.packed([jnp.zeros_like(p) for p in params]), jnp.zeros((), jnp.float32),
                jnp.zeros((), jnp.float32), [consts[p] for p in mutated])
        (grad_sum, loss_sum, weight_sum, carried), _ = jax.lax.scan(
            body, init, (micro, jnp.arange(k)))
        new_consts = list(consts)
        for position, value in zip(mutated, carried):
            new_consts[position] = value
        grads, loss = self.normalise(self.expanded(grad_sum), loss_sum, weight_sum)
        return grads, loss, new_consts


def _jitted_with_arguments(program, step, st, traced: TracedStep, layout: _SpmdLayout | None,
                           values, scalars, device, own_norm: bool, stacking=None):
    """``(jitted program, its arguments to lower with, in_shardings)``."""
    donate = (0, 1) if step.settings.donate else ()
    n_indices, random = traced.layer_indices, traced.random
    if layout is None:
        jitted = jax.jit(program, donate_argnums=donate)
        one = jax.sharding.SingleDeviceSharding(device)
        described = _abstract_inputs(st, scalars, random, [one] * len(st.params),
                                     [one] * len(st.states), [one] * len(st.consts),
                                     [one] * len(st.batch_leaves), one, n_indices,
                                     natural=natural_layout(device.platform), stacking=stacking)
        if values is None:
            args = described
        else:
            # Stacked slots: the call's per-tensor arrays are not the program's arguments.
            stacked = stacking is not None or values["params"] is None
            args = [described[0] if stacked else values["params"],
                    described[1] if stacked else values["states"], values["consts"],
                    values["batch"], jax.device_put(scalars, device),
                    list(_layer_index_values(n_indices, device))]
            if random:
                args.append(jax.ShapeDtypeStruct((), _key_dtype(), sharding=one))
        return jitted, args, None
    shardings, rep = layout.shardings, layout.shardings.replicated
    in_shardings = [layout.flat_params, layout.flat_states, list(shardings.consts),
                    list(shardings.batch), rep, [rep] * n_indices] + ([rep] if random else [])
    out_shardings = (layout.flat_params, layout.flat_states, [rep] * len(traced.mutated),
                     rep) + ((rep,) if own_norm else ())
    jitted = jax.jit(program, in_shardings=tuple(in_shardings), out_shardings=out_shardings,
                     donate_argnums=donate)
    args = _abstract_inputs(st, scalars, random, layout.flat_params, layout.flat_states,
                            shardings.consts, shardings.batch, rep, n_indices)
    return jitted, args, in_shardings


@contextlib.contextmanager
def _attention_form(mesh, batch_shapes, model=None):
    """A program partitioned over several devices runs attention's kernels per device, in a
    ``shard_map`` over the batch axes and heads (XLA's SPMD partitioner does not split a Pallas
    kernel: tpu_train.ops.attention_tpu.per_shard); a mesh of one device (the planner's
    one-chip step) partitions nothing and keeps them as the trainer's step on one chip. Over
    a ``context`` axis, causal attention is the per-shard attention of the split sequence
    (``context_parallel``; ``batch_shapes`` give its length). A model whose config declares a
    ``sliding_window`` has its attention masks checked against that window for the kernels."""
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        window = None
    with contextlib.ExitStack() as forms:
        if mesh is not None and mesh.devices.size > 1:
            forms.enter_context(attention_tpu.per_shard(getattr(mesh, "jax_mesh", mesh),
                                                        BATCH_AXES))
        if mesh is not None:
            forms.enter_context(context_parallel.sequence_split(mesh, batch_shapes, window))
        if window is not None:
            forms.enter_context(attention_tpu.sliding_window(window))
        yield


def build_program(step, st, values, scalars, device, stages, *, mesh=None, plan=None,
                  compile: bool = True, autodiff: str | None = None,
                  compiler_options: dict | None = None) -> Program:
    """Trace, lower and compile the step for the tensors in ``st`` (see ``train_step``).

    ``step`` has the fields of :class:`tpu_train.compile.lowering.StepDefinition`.
    ``mesh`` and ``plan`` (both or neither) compile an SPMD program (module docstring).
    ``values`` may be None: inputs are then described from ``st``'s shapes and dtypes alone
    (on ``device`` without a mesh). ``compile=False`` stops after lowering
    (``Program.executable`` is then None). ``autodiff`` overrides the step's.
    ``compiler_options``: XLA options for the compile (a step that runs here passes the
    runtime's, :func:`tpu_train.device.runtime.compiler_options`; the planner passes none).
    """
    if (mesh is None) != (plan is None):
        raise ValueError("an SPMD step needs both mesh= and plan= (got only "
                         f"{'mesh' if plan is None else 'plan'})")
    natural = mesh is not None or natural_layout(device.platform)
    platform = device.platform if mesh is None else mesh.devices.flat[0].platform
    # Traced and lowered with the same attention form: a scanned layer's residuals are found
    # while tracing (the layer_scan node's outputs) and must be the lowering's.
    batch_shapes = [tuple(b.shape) for b in st.batch_leaves]
    with _attention_form(mesh, batch_shapes, model=step.model), \
            shared_layers.recomputation_fenced(platform == "cpu"):
        traced = trace_step(step, st, scalars, stages,
                             autodiff or step.settings.autodiff, natural)
    layout = None if mesh is None else _spmd_layout(step, st, plan, mesh, traced)
    platform = (mesh.devices.flat[0] if mesh is not None else device).platform
    step_function = _StepFunction(step, st, traced, layout, natural, platform,
                                  stacked_layers.whole_flags(st, values))

    def program(param_flat, state_flat, consts, batch, scalars_in, layer_index, key=None):
        with layer_scan.layer_indices(layer_index):
            return step_function(param_flat, state_flat, consts, batch, scalars_in, key)

    jitted, args, in_shardings = _jitted_with_arguments(program, step, st, traced, layout,
                                                        values, scalars, device,
                                                        own_norm=step_function.own_norm,
                                                        stacking=step_function.stacking)
    try:
        with _attention_form(mesh, batch_shapes, model=step.model), \
                shared_layers.recomputation_fenced(platform == "cpu"):
            lowered = stages.time("lower", jitted.lower, *args)
    except Exception as error:  # noqa: BLE001
        if not traced.jax_autodiff:
            raise
        # A lowering JAX cannot differentiate (a reverse-mode while_loop, a variadic
        # reduction): PyTorch's backward formulas are traced instead.
        fallback = build_program(step, st, values, scalars, device, stages, mesh=mesh,
                                 plan=plan, compile=compile, autodiff="torch",
                                 compiler_options=compiler_options)
        fallback.autodiff_note = "JAX could not differentiate the loss graph: " + \
            f"{type(error).__name__}: {error}".splitlines()[0]
        stages.autodiff_fallback = fallback.autodiff_note
        return fallback
    program = Program(None, traced.random, traced.mutated, traced.grad_norm_dtype,
                      traced.grad_gm, traced.update_gm, lowered=lowered, in_shardings=in_shardings,
                      layer_indices=traced.layer_indices,
                      autodiff="jax" if traced.jax_autodiff else "torch",
                      autodiff_note=traced.autodiff_note, compiler_options=compiler_options,
                      stacking=step_function.stacking)
    return compile_program(program, stages) if compile else program


def compile_program(program: Program, stages) -> Program:
    """``program``, lowered by :func:`build_program` with ``compile=False``, with XLA's
    executable (timed as ``stages``' compile stage). Safe on another thread than the one
    that lowered it: it reads only the lowered module (XLA releases the GIL while it
    compiles). A program too large for the device is a ``ProgramOutOfMemoryError``."""
    executable = memory_errors.compiled(program.lowered, stages, program.compiler_options,
                                        program.in_shardings)
    if program.in_shardings is not None:  # an SPMD program
        executable = PlacingExecutable(executable, program.in_shardings)
    program.executable = executable
    return program


def load_program(program: Program, path, manifest: dict, devices, stages) -> Program:
    """``program``, lowered by :func:`build_program` with ``compile=False``, with the
    executable saved at ``path`` in place of XLA's compile (timed as ``stages.load_s``):
    :func:`tpu_train.compile.saved_executable.load` checks it against the lowered module."""
    from tpu_train.compile import saved_executable

    started = time.perf_counter()
    executable = saved_executable.load(path, program.lowered, manifest=manifest, devices=devices)
    stages.load_s += time.perf_counter() - started
    stages.loaded_from = str(path)
    if program.in_shardings is not None:
        executable = PlacingExecutable(executable, program.in_shardings)
    program.executable = executable
    return program
