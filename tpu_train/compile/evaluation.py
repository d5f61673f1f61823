"""Compiled evaluation: a model's loss over one batch as one XLA program.

``CompiledLoss(model, loss_fn)(batch)`` runs ``loss_fn(model, batch)`` (forward and loss, no
gradient) on the model's ``tpu`` device in a single program call and returns its value on the
host. Op by op, an evaluation pass on a TPU compiles each new op on its first use (each
compile a fraction of a second on a TPU host): validating the default job's model that way
cost more than its whole compiled train step. Traced once per batch shape like the decoder
(:mod:`.decoding`), with the model's parameters and buffers as program inputs, so one program
serves every weight update of a run.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import torch
from jax import lax

from tpu_train.compile import cache as cache_mod
from tpu_train.compile import interpreter, tracing
from tpu_train.compile.decoding import model_arrays, model_tensors
from tpu_train.compile.lowering import autocast_region
from tpu_train.device import runtime
from tpu_train.device.tensor import host_array
from tpu_train.ops import matmul as matmul_mod

__all__ = ["CompiledLoss"]


class _LossModule(torch.nn.Module):
    """``loss_fn(model, batch)`` as a module, so ``functional_call`` can swap the model's
    tensors for graph inputs."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, keys: list[str]):
        super().__init__()
        self.model, self.loss_fn, self.keys = model, loss_fn, keys

    def forward(self, *values):
        return self.loss_fn(self.model, dict(zip(self.keys, values)))


class CompiledLoss:
    """``loss_fn(model, batch)`` of a model on its ``tpu`` device, one program per batch shape.

    ``batch`` is a dict of host tensors; ``loss_fn`` returns one scalar tensor.
    ``autocast_dtype`` (``torch.bfloat16``): the forward runs under autocast to it, as eager
    code in a ``torch.autocast`` region would; None: in the weights' own dtype.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, *,
                 autocast_dtype: torch.dtype | None = None, name: str | None = None,
                 rows_per_piece: int | None = None):
        """``rows_per_piece``: ``loss_fn`` is a sum over the batch's rows (a summed loss, no
        mean): the program computes it over consecutive pieces of this many rows in a loop
        and adds the pieces' sums (a batch whose first dimension it does not divide runs
        whole). XLA's TPU compiler emits code per row of a small array, so a forward over 16
        rows compiles for several times longer than a loop over 2 at a time (the train
        step's ``trainer.micro_batch_size`` for the same reason)."""
        self.model, self.loss_fn, self.autocast_dtype = model, loss_fn, autocast_dtype
        self.rows_per_piece = rows_per_piece
        self.cache = cache_mod.CompileCache(name or f"evaluation of {type(model).__name__}")

    @property
    def compilations(self) -> list[cache_mod.CompileRecord]:
        """One record per compiled program (cause, trace / lower / compile seconds)."""
        return list(self.cache.records)

    def pieces(self, leaves: list[torch.Tensor]) -> int:
        """How many pieces of ``rows_per_piece`` rows a batch of these tensors is summed over
        (1: whole): every batch tensor must have the same number of rows, a multiple of it."""
        per = self.rows_per_piece
        rows = {t.shape[0] if t.dim() else None for t in leaves}
        if not per or len(rows) != 1 or None in rows:
            return 1
        (count,) = rows
        return count // per if count > per and count % per == 0 else 1

    def _prepared(self, batch: dict[str, torch.Tensor]) -> tuple:
        """(signature, build(stages, compile=True), device arrays, batch leaves) for ``batch``."""
        names, tensors = model_tensors(self.model)
        index = tensors[0].device.index or 0
        device = runtime.jax_device(index)
        arrays = model_arrays(names, tensors, device)
        keys = sorted(batch)
        leaves = [batch[k] for k in keys]
        signature = cache_mod.Signature(
            tuple(cache_mod.InputSpec(f'"{n}"', tuple(t.shape), t.dtype)
                  for n, t in zip(names + keys, tensors + leaves)),
            (("model.training", self.model.training), ("autocast", str(self.autocast_dtype)),
             ("matmul precision", matmul_mod.get_matmul_precision()),
             ("rows per piece", self.rows_per_piece)))

        def build(stages, compile: bool = True):
            return self._build(stages, names, tensors, keys, leaves, torch.device("tpu", index),
                               arrays, compile)

        return signature, build, arrays, leaves

    def compile_ahead(self, batch: dict[str, torch.Tensor]) -> bool:
        """Trace and lower the program for batches like ``batch`` now and start XLA's compile
        of it on a thread of its own (``CompileCache.build_ahead``); the first call with such
        a batch (and the model in the same train/eval mode) waits for it. False where that
        program exists already."""
        signature, build, _, _ = self._prepared(batch)
        return self.cache.build_ahead(signature, lambda stages: build(stages, compile=False),
                                      lambda lowered, stages: stages.time("compile",
                                                                          lowered.compile))

    def __call__(self, batch: dict[str, torch.Tensor]) -> float:
        signature, build, arrays, leaves = self._prepared(batch)
        program = self.cache.get_or_build(signature, build)
        return float(program(arrays, [host_array(t) for t in leaves]))

    def _build(self, stages: cache_mod.TimedStages, names, tensors, keys, leaves,
               torch_device: torch.device, arrays, compile: bool = True):
        fakes = tracing.FakeFactory()
        module_keys = ["model." + n for n in names]
        n = len(module_keys)
        wrapper = _LossModule(self.model, self.loss_fn, keys)
        pieces = self.pieces(leaves)
        piece_shapes = [(t.shape[0] // pieces, *t.shape[1:]) for t in leaves]
        inputs = ([fakes.like(t.shape, t.dtype, torch_device) for t in tensors]
                  + [fakes.like(shape, t.dtype, torch_device)
                     for shape, t in zip(piece_shapes, leaves)])

        def loss(*flat):
            return torch.func.functional_call(wrapper, dict(zip(module_keys, flat[:n])),
                                              tuple(flat[n:]))

        def trace():
            with fakes.mode, torch.no_grad(), autocast_region(self.autocast_dtype):
                return tracing._trace(loss, inputs)

        gm = stages.time("trace", trace)
        interpreter.check_lowerings(gm.graph)
        stages.graph_nodes = interpreter.count_ops(gm)
        shapes = [tuple(t.shape) for t in tensors]

        def program(flat, batch_values):
            params = [a.reshape(shape) for a, shape in zip(flat, shapes)]

            def piece_loss(piece):
                loss, _ = interpreter.run_graph(gm, params + list(piece))  # its one output
                return loss

            if pieces == 1:
                return piece_loss(batch_values)
            split = [b.reshape((pieces, *shape)) for b, shape in zip(batch_values, piece_shapes)]
            return jnp.sum(lax.map(piece_loss, split))

        args = [arrays, [jax.ShapeDtypeStruct(a.shape, a.dtype)
                         for a in map(host_array, leaves)]]
        lowered = stages.time("lower", jax.jit(program).lower, *args)
        return stages.time("compile", lowered.compile) if compile else lowered
