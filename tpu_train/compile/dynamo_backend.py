"""``torch.compile(model, backend="tpu")``: each dynamo graph becomes jitted JAX programs.

Dynamo hands the backend one FX graph per region between graph breaks. The backend runs
AOTAutograd over it (with the same decomposition table as :func:`compile_train_step`), so
the forward and — when gradients are needed — the backward graph arrive as functional aten
graphs; each is interpreted with the shared aten→JAX lowering table
(:func:`tpu_train.compile.interpreter.run_graph`) inside one ``jax.jit``. Code dynamo cannot
trace (``print``, ``.item()``, data-dependent Python) runs eagerly on the ``tpu`` device
between the compiled regions, as with any backend.

Making dynamo see ``tpu`` tensors as tensors
--------------------------------------------
Dynamo only models a tensor subclass with its own ``__torch_dispatch__`` as a tensor when
the subclass follows the traceable-wrapper protocol (``__tensor_flatten__`` /
``__tensor_unflatten__``); otherwise it treats it as an opaque Python object and traces
*into* the device's dispatcher (measured: graph breaks in ``F.linear`` and dynamo compiling
frames of ``tpu_train.device.dispatch``). A ``TpuTensor`` holds no inner torch tensors — its
data is a JAX buffer — so :func:`install_traceable_protocol` gives it a protocol that
flattens to *no* inner tensors plus ``(dtype, device)`` metadata and unflattens to a plain
fake tensor on the ``tpu`` device. Dynamo and AOTAutograd therefore trace ordinary fake
``tpu`` tensors (no subclass desugaring), and at run time the compiled function receives
the real ``TpuTensor`` objects and reads their buffers.

One place in torch treats a traceable subclass differently in eager code:
``nn.Module._apply`` (``model.to(tpu)``) swaps parameters with ``torch.utils.swap_tensors``,
which fails between a CPU tensor and a ``TpuTensor`` (different ``__slots__``). The protocol
is hidden from that one caller (see :class:`_ProtocolAttribute`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import jax
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from tpu_train.compile import interpreter, tracing
from tpu_train.device import rng, runtime
from tpu_train.device.tensor import TpuTensor, put_cpu_tensor, wrap
from tpu_train.ops import registry

__all__ = ["BACKEND_NAME", "install_traceable_protocol", "register", "tpu_backend"]

BACKEND_NAME = "tpu"


# --------------------------------------------------------------------------- the protocol

def _flatten(self: TpuTensor):
    # No inner tensors: the data is a JAX buffer, which the compiled function reads at run
    # time. The metadata is what dynamo's TENSOR_SUBCLASS_METADATA_MATCH guard compares.
    return [], (self.dtype, self.device)


def _unflatten(inner: dict, ctx, outer_size, outer_stride):
    dtype, device = ctx
    mode = torch._guards.detect_fake_mode() or FakeTensorMode()
    meta = torch.empty_strided(tuple(outer_size), tuple(outer_stride), dtype=dtype,
                               device="meta")
    return FakeTensor(mode, meta, device)


# Callers that must see a TpuTensor as an ordinary tensor: Module._apply (swap_tensors
# fails across __slots__), and AOTAutograd's backward prologue, which handles a plain
# tangent as is but expects a traceable one to carry subclass metadata.
_HIDDEN_FROM = frozenset({"_apply", "process_runtime_tangent"})


def _coerce_tangent(self, expected_metadata, expected_type=None):
    # The forward traced plain fake tensors, so a tpu tangent already is what it expects.
    return self


def _called_from_module_apply() -> bool:
    """Is ``nn.Module._apply`` among the nearest callers (the swap_tensors check)?"""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_name in _HIDDEN_FROM:
            return True
        frame = frame.f_back
    return False


class _ProtocolAttribute:
    """A class attribute that ``hasattr`` sees everywhere except from ``Module._apply``."""

    def __init__(self, fn: Callable, static: bool):
        self.fn, self.static = fn, static

    def __get__(self, obj, owner=None):
        if _called_from_module_apply():
            raise AttributeError("the traceable-subclass protocol is hidden from Module._apply")
        if self.static or obj is None:
            return self.fn
        return self.fn.__get__(obj, owner)


def install_traceable_protocol() -> None:
    """Give ``TpuTensor`` the traceable-wrapper protocol dynamo needs (idempotent)."""
    if "__tensor_flatten__" not in TpuTensor.__dict__:
        TpuTensor.__tensor_flatten__ = _ProtocolAttribute(_flatten, static=False)
        TpuTensor.__tensor_unflatten__ = _ProtocolAttribute(_unflatten, static=True)
        TpuTensor.__coerce_same_metadata_as_tangent__ = _coerce_tangent


# --------------------------------------------------------------------------- graph → JAX

def _as_jax(value, device_index: int):
    if isinstance(value, TpuTensor):
        return value.jax_value()
    if isinstance(value, torch.Tensor):
        return put_cpu_tensor(value, runtime.jax_device(device_index), flat=False)
    return value


def _has_random_ops(gm: torch.fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            lowering = registry.get_lowering(node.target)
            if lowering is not None and lowering.draws_random(node.args, node.kwargs):
                return True
    return False


def _output_dtypes(gm: torch.fx.GraphModule) -> list:
    """Per flat graph output: its torch dtype (None for non-tensors), from the fake values."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, _ = tree_flatten(output.args[0])
    dtypes = []
    for leaf in leaves:
        val = leaf.meta.get("val") if isinstance(leaf, torch.fx.Node) else None
        dtypes.append(val.dtype if isinstance(val, torch.Tensor) else None)
    return dtypes


def _device_index(example_inputs: Sequence) -> int:
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type == "tpu":
            return x.device.index or 0
    return 0


def lower_graph(gm: torch.fx.GraphModule, example_inputs: Sequence) -> Callable:
    """One AOTAutograd graph (forward or backward) as a callable over ``tpu`` tensors."""
    interpreter.check_lowerings(gm.graph)
    index = _device_index(example_inputs)
    random = _has_random_ops(gm)
    out_dtypes = _output_dtypes(gm)

    def program(inputs, key):
        outputs, mutations = interpreter.run_graph(gm, inputs, rng_key=key)
        if mutations:
            # aot_autograd (without keep_inference_input_mutations) returns input mutations
            # as graph outputs, so a copy_ into an input left in the graph is unexpected.
            raise NotImplementedError("input mutation inside a tpu-compiled graph")
        return outputs

    jitted = jax.jit(program)

    @torch._dynamo.disable
    def run(*args):
        # Python scalars (symbolic sizes) stay static: a new value recompiles, as it would
        # have specialized in dynamo anyway.
        inputs = [_as_jax(a, index) for a in args]
        key = rng.next_key(index) if random else None
        outputs = jitted(inputs, key)
        flat, spec = tree_flatten(outputs)
        wrapped = [wrap(v, dtype, index) if dtype is not None and hasattr(v, "shape") else v
                   for v, dtype in zip(flat, out_dtypes)]
        return tree_unflatten(wrapped, spec)

    return run


def tpu_backend(gm: torch.fx.GraphModule, example_inputs: Sequence, **kwargs: Any):
    """The dynamo backend: AOTAutograd with the lowering table's decompositions."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(graph, inputs):
        return make_boxed_func(lower_graph(graph, inputs))

    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                           decompositions=tracing.decomposition_table())
    return backend(gm, _fake_inputs(example_inputs), **kwargs)


def _fake_inputs(example_inputs: Sequence) -> list:
    """Dynamo's fake tensors in place of the real ``TpuTensor`` example inputs.

    AOTAutograd leaves a traceable subclass whose inner tensors are all fake untouched — with
    no inner tensors that is vacuously true, so it would trace the real tensor. Handing it
    the fake tensors dynamo already made (memoized by the fake mode) avoids that."""
    context = torch._guards.TracingContext.try_get()
    mode = context.fake_mode if context is not None else None
    if mode is None:
        return list(example_inputs)
    out = []
    for x in example_inputs:
        if isinstance(x, TpuTensor):
            symbolic = context.tensor_to_context.get(x)
            x = mode.from_tensor(x, symbolic_context=symbolic,
                                 source=symbolic.tensor_source if symbolic else None)
        out.append(x)
    return out


def register() -> None:
    """Register the ``"tpu"`` dynamo backend and the protocol (safe to call twice).

    An installed tpu_train also declares the backend as a ``torch_dynamo_backends`` entry point
    (pyproject.toml), which torch loads on the first ``torch.compile(backend="tpu")`` — so it
    works after a bare ``import tpu_train`` without importing dynamo then. While torch loads
    that entry point (which imports this module), the name is left to torch: registering it
    here as well would make torch's own registration fail as a duplicate."""
    install_traceable_protocol()
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if _COMPILER_FNS.get(BACKEND_NAME) is tpu_backend:
        return
    if BACKEND_NAME not in _COMPILER_FNS and _BACKENDS.get(BACKEND_NAME) is not None:
        return  # an entry point torch is about to load (or will load on first use)
    _BACKENDS.pop(BACKEND_NAME, None)
    _COMPILER_FNS.pop(BACKEND_NAME, None)
    register_backend(tpu_backend, name=BACKEND_NAME)
