"""Run a traced (functional, decomposed) FX graph on JAX values with the shared lowering table.

The graphs come from ``make_fx(functionalize(...))`` over fake tensors, so every node is an
``aten`` op overload on values: there is no aliasing left to emulate. Each node is lowered
with :func:`tpu_train.ops.registry.get_lowering` — the same functions eager mode uses — and
view ops therefore become reshapes, transposes, static slices and broadcasts of values (the
lowerings in :mod:`tpu_train.ops.shape`), never gathers from an emulated storage.

The interpreter is meant to run *inside* ``jax.jit`` tracing: it is plain Python over the
graph, producing one XLA program for the whole graph.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from tpu_train.compile.remat_regions import OPTIMIZATION_BARRIER
from tpu_train.ops import registry
from tpu_train.ops.dtypes import storage_dtype

aten = torch.ops.aten


class MissingLoweringError(NotImplementedError):
    """The traced step uses aten ops that have no lowering (listed all at once)."""


# Graph-level ops of the compile layer itself (a scanned layer stack): ``op -> fn(*args,
# constrain=..., uses=...)`` returning the node's value; ``uses`` holds, per tensor argument,
# the at-use function of run_graph (or None). Registered by the modules that define them.
GRAPH_OPS: dict = {}
# Graph ops whose at-use reads are ordered like other ops' (:class:`_OrderedReads`), each one
# call a chunk of its own: a shared layer's call reads one layer's weights.
ORDERED_GRAPH_OPS: set = set()


# Mutating ops that survive functionalization when a forward writes a tensor inside a
# ``torch.func`` transform (BatchNorm's running statistics under ``grad``): their functional
# variant, and which of its outputs is the new value of which written argument.
_FUNCTIONAL_VARIANTS = {
    aten._native_batch_norm_legit.default: (
        aten._native_batch_norm_legit_functional.default, 3, {3: 3, 4: 4}),
}


def functional_variant(op: torch._ops.OpOverload):
    """``(functional op, number of outputs the mutating op returns, {arg index: output
    index})`` for a mutating op, or None when there is no known functional form.

    In-place ops ``name_.overload`` map to ``name.overload`` writing argument 0."""
    if op in _FUNCTIONAL_VARIANTS:
        return _FUNCTIONAL_VARIANTS[op]
    name = op._schema.name.split("::")[-1]
    if name.endswith("_") and not name.startswith("_"):
        packet = getattr(aten, name[:-1], None)
        overload = getattr(packet, op._overloadname, None) if packet is not None else None
        if overload is not None and registry.get_lowering(overload) is not None:
            return overload, None, {0: None}
    return None


def written_arguments(node: torch.fx.Node) -> list[int]:
    """Positions of the arguments a (mutating) call node writes, per the op's schema."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    return [i for i, a in enumerate(node.target._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write and i < len(node.args)]


def check_lowerings(graph: torch.fx.Graph) -> None:
    """Raise :class:`MissingLoweringError` naming every op of ``graph`` without a lowering,
    before any JAX tracing starts (one clear error instead of the first one hit)."""
    missing = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if node.target in (aten.copy_.default, OPTIMIZATION_BARRIER) or node.target in GRAPH_OPS:
            continue  # input mutation / a remat region's fence: handled by the interpreter
        if isinstance(node.target, torch._ops.OpOverload) and registry.is_mutating(node.target):
            if functional_variant(node.target) is None:
                missing.add(f"{node.target} (mutating, no functional form known)")
            continue
        if not isinstance(node.target, torch._ops.OpOverload) or \
                registry.get_lowering(node.target) is None:
            missing.add(str(node.target))
    if missing:
        raise MissingLoweringError(
            "the traced training step uses ops with no lowering in tpu_train.ops: "
            + ", ".join(sorted(missing))
            + ". Add a lowering (see tpu_train/ops/registry.py) for each of them.")


def fence(values: Sequence[Any]) -> list:
    """The values, computed behind something XLA cannot see through.

    ``optimization_barrier`` alone is not enough on every backend: XLA's CPU pipeline expands
    barriers before its late CSE passes, which then merge a checkpointed region's
    recomputation with its forward (measured: no memory saved). The values therefore also
    pass through a conditional on ``last == last`` for the first element of the last value
    (the incoming gradient): XLA cannot fold it (it is false for NaN), so it neither merges
    what follows with the forward nor runs it before that gradient exists. The other branch
    poisons floats with NaN, which is what a NaN gradient leads to anyway."""
    values = tuple(jax.lax.optimization_barrier(tuple(values)))
    probe = values[-1].reshape(-1)[0]

    def poisoned(vs):
        return tuple(jnp.full_like(v, jnp.nan) if jnp.issubdtype(v.dtype, jnp.floating) else v
                     for v in vs)

    return list(jax.lax.cond(probe == probe, lambda vs: vs, poisoned, values))


def after(values: Sequence[Any], anchor: Any) -> list:
    """``values``, available to XLA only once ``anchor`` exists (the same elements).

    A data dependency XLA cannot remove (see :func:`fence`): one conditional on
    ``anchor[0] == anchor[0]``, false only for NaN, whose other branch poisons floats with
    NaN, which a NaN activation leads to anyway. (Measured on an 8-layer 8B slice: an
    ``optimization_barrier`` with the anchor, or ``value * (1 + 0 * anchor[0])``, left XLA's
    CPU scheduler free to hoist the gathers: no memory saved.)
    """
    probe = anchor.reshape(-1)[0]

    def poisoned(vs):
        return tuple(jnp.full_like(v, jnp.nan) if jnp.issubdtype(v.dtype, jnp.floating) else v
                     for v in vs)

    return list(jax.lax.cond(probe == probe, lambda vs: vs, poisoned, tuple(values)))


def _is_activation(value: Any) -> bool:
    """A non-empty floating-point array (a single op result, not a tuple of them)."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and \
        getattr(value, "size", 0) > 0


def _carried(gm: torch.fx.GraphModule, placeholders, at_use: dict) -> dict:
    """Nodes whose value is an ``at_use`` input: the input itself, and what a checkpoint
    region's barrier passes through from it (the region reads its weights fenced)."""
    carries = {node: at_use[i] for i, node in enumerate(placeholders) if i in at_use}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and source.target is OPTIMIZATION_BARRIER:
                fenced = source.args[0][node.args[1]]
                if fenced in carries:
                    carries[node] = carries[fenced]
    return carries


# Ops reading at-use values per ordered chunk: about one Llama layer's weights (7 matrices,
# 2 norms). Memory: about two chunks' gathered weights; compile time: one conditional per
# chunk (one per read doubled XLA's CPU compile of a 32-layer 8B step).
READS_PER_CHUNK = 8


class _OrderedReads:
    """Where the at-use values (FSDP weights) an op reads become available to XLA.

    The ops that read them are taken in graph order in chunks of ``READS_PER_CHUNK``. When
    chunk ``j`` starts, the weights it reads pass through one :func:`after` anchored on the
    activation that was the latest when chunk ``j - 1`` started: chunk ``j``'s gathers can
    overlap chunk ``j - 1``'s compute but not run earlier. Left free, XLA's CPU scheduler
    issued every layer's forward all-gathers before the forward's first matmul (8B, 4 layers,
    16 devices: all of them at instructions 243-264 of 1523, the first dot at 281), so all
    gathered weights were live at the peak and activation checkpointing saved none of them.
    Values first computed inside a chunk (a recomputed region's fenced weights) are already
    ordered by their fence and are read as they are.
    """

    def __init__(self, gm: torch.fx.GraphModule, carries: dict):
        self._chunk_of: dict = {}
        self._sources: list[list] = []
        reads = 0
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target in (operator.getitem,
                                                              OPTIMIZATION_BARRIER):
                continue
            read = [a for a in tree_flatten((node.args, node.kwargs))[0]
                    if isinstance(a, torch.fx.Node) and a in carries]
            if not read:
                continue
            whole = node.target in ORDERED_GRAPH_OPS  # one layer's call: a chunk of its own
            if whole:
                reads = -(-reads // READS_PER_CHUNK) * READS_PER_CHUNK
            chunk = reads // READS_PER_CHUNK
            reads += READS_PER_CHUNK if whole else 1
            if chunk == len(self._sources):
                self._sources.append([])
            self._chunk_of[node] = chunk
            for source in read:
                if source not in self._sources[chunk]:
                    self._sources[chunk].append(source)
        self._latest = None  # the latest activation computed so far
        self._starts: dict[int, Any] = {}  # chunk -> the latest activation when it started
        self._current = -1
        self._gated: dict = {}

    def enter(self, node, env):
        """Called before ``node`` runs."""
        chunk = self._chunk_of.get(node)
        if chunk is None or chunk == self._current:
            return
        self._current = chunk
        self._starts[chunk] = self._latest
        anchor = self._starts.get(chunk - 1)
        ready = [s for s in self._sources[chunk] if s in env]
        self._gated = {}
        if anchor is not None and ready:
            self._gated = dict(zip(ready, after([env[s] for s in ready], anchor)))

    def value(self, source, env):
        return self._gated.get(source, env[source])

    def saw(self, value):
        """Called with each op's result."""
        if _is_activation(value):
            self._latest = value


def _constant_value(value: Any) -> Any:
    """A graph constant (``get_attr``) as a JAX value."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, FakeTensor):
        raise RuntimeError(
            "the traced step captured a fake tensor as a constant; pass every tensor the step "
            "reads as a module parameter, buffer or batch entry")
    if isinstance(value, torch.Tensor):
        from tpu_train.device.tensor import TpuTensor, host_array

        if isinstance(value, TpuTensor):
            return value.jax_value()
        return jnp.asarray(host_array(value))
    return value


def _node_dtypes(node: torch.fx.Node):
    """The torch dtypes of a node's tensor outputs as its fake values record them (flat)."""
    val = node.meta.get("val")
    if val is None:
        return None
    leaves, _ = tree_flatten(val)
    return [leaf.dtype if isinstance(leaf, torch.Tensor) else None for leaf in leaves]


def _cast_to_torch_dtypes(result, dtypes):
    """Cast a lowering's outputs to the storage dtypes of torch's predicted dtypes (torch's
    type promotion stays authoritative; a lowering may compute wider)."""
    if dtypes is None:
        return result
    leaves, spec = tree_flatten(result)
    if len(leaves) != len(dtypes):
        return result
    cast = []
    for leaf, dtype in zip(leaves, dtypes):
        if dtype is not None and hasattr(leaf, "astype"):
            target = storage_dtype(dtype)
            if leaf.dtype != target:
                leaf = leaf.astype(target)
        cast.append(leaf)
    return tree_unflatten(cast, spec)


def _plain(value):
    """FX's immutable containers as plain lists / tuples / dicts (JAX pytree-friendly)."""
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def run_graph(gm: torch.fx.GraphModule, inputs: Sequence[Any], *, rng_key=None,
              constrain: Callable[[Any], Any] | None = None,
              at_use: dict[int, Callable[[Any], Any]] | None = None):
    """Evaluate ``gm`` on JAX ``inputs`` (one per placeholder, in order).

    Returns ``(outputs, mutations)``: the graph's output structure with JAX values, and a dict
    ``placeholder index -> new value`` for inputs the graph overwrote (functionalization
    turns writes into graph inputs — e.g. a BatchNorm running statistic — into trailing
    ``copy_`` nodes).
    Random ops receive ``rng_key`` folded with a per-node counter, so each random node draws
    an independent stream and the whole step is reproducible from one key. ``constrain``, if
    given, is applied to every op's array result (SPMD steps pin activations with it).
    ``at_use`` maps input positions to a function applied where an op *reads* that input (or
    a fenced copy of it), not once at the top: SPMD steps all-gather FSDP weights with it, so
    a checkpointed region's recomputation gathers its weights again instead of keeping the
    forward's gathered copies alive until the backward. Those reads are also ordered (see
    :class:`_OrderedReads`): without that XLA's CPU scheduler issued every layer's forward
    all-gathers before the first matmul.
    """
    return _GraphRun(gm, inputs, rng_key, constrain, at_use).run()


class _GraphRun:
    """One evaluation of a graph (:func:`run_graph`): the values of its nodes so far."""

    def __init__(self, gm, inputs, rng_key, constrain, at_use):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(inputs):
            raise ValueError(f"graph has {len(placeholders)} inputs, got {len(inputs)} values")
        self.gm, self.rng_key, self.constrain = gm, rng_key, constrain
        self.env: dict[torch.fx.Node, Any] = dict(zip(placeholders, inputs))
        self.index_of = {node: i for i, node in enumerate(placeholders)}
        self.mutations: dict[int, Any] = {}
        self.random_counter = 0
        self.carries = _carried(gm, placeholders, at_use or {})
        self.order = _OrderedReads(gm, self.carries) if self.carries else None

    def load(self, arg):
        return self.env[arg] if isinstance(arg, torch.fx.Node) else arg

    def load_for_use(self, arg):
        if isinstance(arg, torch.fx.Node) and arg in self.carries:
            return self.carries[arg](self.order.value(arg, self.env))
        return self.load(arg)

    def run(self):
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "get_attr":
                self.env[node] = _constant_value(getattr(self.gm, node.target))
            elif node.op == "output":
                return _plain(tree_map(self.load, node.args[0])), self.mutations
            elif node.op == "call_function":
                self.env[node] = self._evaluate(node)
            else:
                raise NotImplementedError(
                    f"unexpected FX node kind {node.op} ({node.format_node()})")
        return None, self.mutations

    def _evaluate(self, node):
        target = node.target
        if target is operator.getitem:
            args = tree_map(self.load, node.args)
            return args[0][args[1]]
        if target is OPTIMIZATION_BARRIER:
            # Recomputed checkpoint regions start from fenced values (see .remat_regions).
            return fence(tree_map(self.load, node.args)[0])
        if target in GRAPH_OPS:
            # The op applies the at-use functions itself, where its body reads each input;
            # they become available in order like other ops' reads (a layer's call: a chunk).
            uses = [self.carries.get(a) if isinstance(a, torch.fx.Node) else None
                    for a in tree_flatten(node.args)[0]]
            if self.order is None or target not in ORDERED_GRAPH_OPS:
                return GRAPH_OPS[target](*tree_map(self.load, node.args),
                                         constrain=self.constrain, uses=uses[1:])
            self.order.enter(node, self.env)
            args = tree_map(lambda a: self.order.value(a, self.env)
                            if isinstance(a, torch.fx.Node) and a in self.carries
                            else self.load(a), node.args)
            value = GRAPH_OPS[target](*args, constrain=self.constrain, uses=uses[1:])
            self.order.saw(value[0] if isinstance(value, (list, tuple)) and value else value)
            return value
        if self.order is not None:
            self.order.enter(node, self.env)
        args = tree_map(self.load_for_use, node.args)
        kwargs = tree_map(self.load_for_use, node.kwargs)
        if target is aten.copy_.default:
            return self._copy_into_input(node, args)
        return self._call(node, target, args, kwargs)

    def _copy_into_input(self, node, args):
        destination = node.args[0]
        if destination not in self.index_of:
            raise NotImplementedError(
                f"copy_ into an intermediate value in a functional graph ({node.format_node()})")
        value = jnp.broadcast_to(args[1], args[0].shape).astype(args[0].dtype)
        self.mutations[self.index_of[destination]] = value
        self.env[destination] = value  # later readers see the written value
        return value

    def _call(self, node, target, args, kwargs):
        writes = None
        if isinstance(target, torch._ops.OpOverload) and registry.is_mutating(target):
            variant = functional_variant(target)
            if variant is None:
                raise MissingLoweringError(f"no functional form of {target} ({node.format_node()})")
            target, n_returns, writes = variant
        lowering = registry.get_lowering(target)
        if lowering is None:
            raise MissingLoweringError(f"no lowering for {target} ({node.format_node()})")
        args, kwargs = registry.scalars_as_arrays(target, args, kwargs)
        if lowering.random and not lowering.draws_random(args, kwargs):
            kwargs = dict(kwargs, rng_key=None)
        elif lowering.random:
            if self.rng_key is None:
                raise ValueError(f"{target} is random but the graph was run without an rng_key")
            kwargs = dict(kwargs, rng_key=jax.random.fold_in(self.rng_key, self.random_counter))
            self.random_counter += 1
        result = lowering.fn(*args, **kwargs)
        if writes is None:
            value = _cast_to_torch_dtypes(result, _node_dtypes(node))
            if self.constrain is not None:
                value = jax.tree_util.tree_map(self.constrain, value)
            if self.order is not None:
                self.order.saw(value)
            return value
        # A write into a tensor the graph reads: later nodes, and the caller for graph
        # inputs, see the new value (cast back to the written tensor's dtype).
        for arg_index, out_index in writes.items():
            destination = node.args[arg_index]
            new = result if out_index is None else result[out_index]
            new = new.astype(self.env[destination].dtype)
            self.env[destination] = new
            if destination in self.index_of:
                self.mutations[self.index_of[destination]] = new
        value = result if n_returns is None else tuple(result[:n_returns])
        return _cast_to_torch_dtypes(value, _node_dtypes(node))


def count_ops(gm: torch.fx.GraphModule) -> int:
    """Number of op nodes in a graph (a size figure for logs)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")
