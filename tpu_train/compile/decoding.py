"""Compiled decoding: prefill and the whole decode loop as one XLA program per bucket.

``CompiledDecoder(model, decoding).generate(prompts, max_new_tokens, ...)`` continues a batch
of prompts of any lengths on the model's ``tpu`` device with a single program call: the prompt
forward (prefill), then ``lax.while_loop`` over one-token steps through a static KV cache,
stopping when every row has produced an end token or ``max_new_tokens`` are out.

The compile layer knows nothing about the model. ``decoding`` is the model layer's half,
plain PyTorch (``tpu_train.models.generation.StaticCacheDecoding`` for our Llama):

* ``max_length(model)``: the longest sequence the model accepts;
* ``cache_shapes(model, batch, length)``: ``[(shape, dtype), ...]`` of the cache tensors;
* ``step(model, tokens, slot, pad, caches) -> (logits [batch, vocab], new caches)``: the
  forward of ``tokens`` ``[batch, seq]`` written at cache slots ``slot ...`` (a 0-dim tensor),
  rows left-padded by ``pad`` ``[batch]``, returning the last position's logits;
* ``sample(logits, temperature, top_p) -> tokens [batch]``.

``step`` + ``sample`` are traced twice with ``make_fx`` over fake tensors (as the training
step is, :mod:`.tracing`): once for the prompt block, once for a single token. The graphs run
through the shared aten→JAX interpreter inside one ``jax.jit``; the loop around them is JAX.
The model's parameters and buffers are program *inputs*, so one program serves every weight
update of a training run (only shapes, dtypes and the settings below recompile).

Buckets (:func:`choose_buckets`): the batch is rounded up to a power of two, the prompt length
and the number of new tokens each to a power of two of at least 16 (capped so that their sum
fits ``max_length``). Prompts are left-padded to the prompt bucket; ``max_new_tokens`` and the
end tokens are program inputs, so any request that falls in a bucket reuses its program.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpu_train.compile import cache as cache_mod
from tpu_train.compile import interpreter, tracing
from tpu_train.compile.lowering import autocast_region
from tpu_train.device import runtime
from tpu_train.device.storage import shape_whole
from tpu_train.device.tensor import TpuTensor, owns_whole_storage, storage_of
from tpu_train.ops import matmul as matmul_mod
from tpu_train.ops.dtypes import storage_dtype

__all__ = ["Buckets", "CompiledDecoder", "choose_buckets"]

MIN_LENGTH_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The static shapes of one decoding program."""

    batch: int
    prompt: int  # prompt slots (left-padded)
    new: int  # the most tokens the program can generate

    @property
    def total(self) -> int:
        return self.prompt + self.new


def _power_of_two(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


def choose_buckets(batch: int, prompt_len: int, max_new_tokens: int, max_length: int) -> Buckets:
    """Powers of two for the batch, the prompt and the new tokens (prompt and new at least
    ``MIN_LENGTH_BUCKET``), shrunk to fit ``max_length`` when the rounding overflows it."""
    if prompt_len + max_new_tokens > max_length:
        raise ValueError(
            f"prompt length + max_new_tokens = {prompt_len} + {max_new_tokens} exceeds the "
            f"model's max_seq_len {max_length}")
    prompt = min(_power_of_two(prompt_len, MIN_LENGTH_BUCKET), max_length - max_new_tokens)
    new = min(_power_of_two(max_new_tokens, MIN_LENGTH_BUCKET), max_length - prompt)
    return Buckets(_power_of_two(batch), prompt, new)


class _DecodeModule(torch.nn.Module):
    """``decoding.step`` + ``decoding.sample`` as a module, so ``functional_call`` can swap
    the model's tensors for graph inputs."""

    def __init__(self, model, decoding, temperature: float, top_p: float):
        super().__init__()
        self.model = model
        self.decoding, self.temperature, self.top_p = decoding, temperature, top_p

    def forward(self, tokens, slot, pad, caches):
        logits, caches = self.decoding.step(self.model, tokens, slot, pad, caches)
        return [self.decoding.sample(logits, self.temperature, self.top_p)] + list(caches)


def _trace_step(wrapper: _DecodeModule, names: Sequence[str], tensors: Sequence[torch.Tensor],
                buckets: Buckets, seq: int, cache_shapes, device: torch.device,
                autocast_dtype: torch.dtype | None = None):
    """The graph ``(model tensors, tokens [B, seq], slot, pad [B], caches) -> (next tokens,
    new caches)``, traced under autocast to ``autocast_dtype`` (None: none, whatever region is
    active around the call)."""
    fakes = tracing.FakeFactory()
    keys = ["model." + n for n in names]
    n = len(keys)
    inputs = [fakes.like(t.shape, t.dtype, device) for t in tensors]
    inputs += [fakes.like((buckets.batch, seq), torch.long, device),
               fakes.like((), torch.long, device),
               fakes.like((buckets.batch,), torch.long, device)]
    inputs += [fakes.like(shape, dtype, device) for shape, dtype in cache_shapes]

    def step(*flat):
        tokens, slot, pad = flat[n:n + 3]
        return torch.func.functional_call(wrapper, dict(zip(keys, flat[:n])),
                                          (tokens, slot, pad, list(flat[n + 3:])))

    with fakes.mode, torch.no_grad(), autocast_region(autocast_dtype):
        gm = tracing._trace(step, inputs)
    interpreter.check_lowerings(gm.graph)
    return gm


def model_tensors(model: torch.nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The names and tensors a compiled program takes as inputs: parameters, then buffers."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    return [n for n, _ in named], [t for _, t in named]


def model_array(tensor: torch.Tensor, device, name: str):
    """``tensor``'s elements on the JAX ``device`` as the platform keeps whole buffers
    (:func:`tpu_train.device.runtime.natural_buffers`): flat on the CPU client, in the tensor's
    shape on a TPU. A tensor that is its whole storage passes its storage's own buffer (no
    work per call: a reshape per tensor cost 1.5 ms of dispatch, 60 ms per call for
    debug_tiny), and a storage a compiled train step keeps in its natural shape is not
    flattened for validation only to be reshaped by the next step (on a TPU each is a copy,
    and a program per shape to compile). A buffer replicated over several devices (the
    data-parallel layout) passes one replica. The programs reshape what they get to the
    tensors' shapes (nothing to do for a shaped one)."""
    if not isinstance(tensor, TpuTensor):
        raise TypeError(f'"{name}" is on {tensor.device}: compiled decoding needs the model on '
                        "the tpu device")
    natural = runtime.natural_buffers(device.platform)
    if owns_whole_storage(tensor):
        storage = storage_of(tensor)
        value = storage.shaped(tuple(tensor.shape)) if natural else storage.buffer
    else:
        value = tensor.jax_value()
        value = value if natural else value.reshape(-1)
    if value.devices() == {device}:
        return value
    if value.sharding.is_fully_replicated:
        for shard in value.addressable_shards:
            if shard.device == device:
                return shard.data
    raise ValueError(f'"{name}" is split over {len(value.devices())} devices: compiled decoding '
                     "needs every parameter whole on one device (or replicated)")


def model_arrays(names: list[str], tensors: list[torch.Tensor], device) -> list:
    """:func:`model_array` of each tensor, where the platform keeps natural shapes every
    reshape done by one program (:func:`tpu_train.device.storage.shape_whole`), not one per
    shape: on a TPU each is a program to compile before the first validation."""
    if runtime.natural_buffers(device.platform):
        whole = [t for t in tensors if isinstance(t, TpuTensor) and owns_whole_storage(t)]
        shape_whole([storage_of(t) for t in whole], [tuple(t.shape) for t in whole])
    return [model_array(t, device, n) for n, t in zip(names, tensors)]


class CompiledDecoder:
    """Greedy or sampled continuations of a model on its ``tpu`` device (module docstring).

    ``early_stop=False`` runs every one of ``max_new_tokens`` steps (finished rows repeat the
    end token) instead of leaving the loop once every row has ended. ``autocast_dtype``
    (``torch.bfloat16``): the model runs under autocast to it, as eager code in a
    ``torch.autocast`` region would; None (the default): in the weights' own dtype.
    """

    def __init__(self, model: torch.nn.Module, decoding: Any, *, early_stop: bool = True,
                 warn_after: int = cache_mod.DEFAULT_WARN_AFTER, name: str | None = None,
                 autocast_dtype: torch.dtype | None = None):
        self.model, self.decoding, self.early_stop = model, decoding, bool(early_stop)
        self.autocast_dtype = autocast_dtype
        self.cache = cache_mod.CompileCache(
            name or f"decoder of {type(model).__name__}", warn_after=warn_after)

    @property
    def compilations(self) -> list[cache_mod.CompileRecord]:
        """One record per compiled program (cause, trace / lower / compile seconds)."""
        return list(self.cache.records)

    def generate(self, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int, *,
                 temperature: float = 0.0, top_p: float = 1.0,
                 eos_token_id: int | Sequence[int] | None = None, seed: int = 0,
                 batch_size: int | None = None) -> torch.Tensor:
        """The new tokens ``[len(prompts), n]`` (CPU, int64), ``n <= max_new_tokens``.

        ``prompts``: token-id lists of any lengths (or a ``[batch, len]`` tensor). Greedy when
        ``temperature == 0``, else sampled with temperature and nucleus ``top_p``
        (reproducible from ``seed``; the device's random stream is not touched). Like
        :func:`tpu_train.models.generate`, a row that produced one of ``eos_token_id`` repeats
        the first of them, and ``n`` ends where every row has ended. ``batch_size``: the batch
        bucket to use (at least ``len(prompts)``), e.g. to give a last, shorter chunk the
        program of the full ones.
        """
        rows = self._rows(prompts, max_new_tokens)
        if max_new_tokens == 0:
            return torch.zeros((len(rows), 0), dtype=torch.long)
        entry, buckets, device, arrays, eos = self._program(
            rows, max_new_tokens, temperature, top_p, eos_token_id, batch_size,
            self.cache.get_or_build)
        prompt, pad, finished = _left_padded(rows, buckets)
        args = [jax.device_put(a, device) for a in (
            prompt, pad, finished, np.int32(max_new_tokens), np.array(eos, np.int32))]
        key = jax.device_put(jax.random.key(seed), device)
        out, count = entry(arrays, *args, key)
        return torch.from_numpy(np.asarray(out)[:len(rows), :int(count)].astype(np.int64))

    def compile_ahead(self, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int,
                      *, temperature: float = 0.0, top_p: float = 1.0,
                      eos_token_id: int | Sequence[int] | None = None,
                      batch_size: int | None = None) -> bool:
        """Trace and lower the program :meth:`generate` would use for these arguments now and
        start XLA's compile of it on a thread of its own (``CompileCache.build_ahead``); the
        first :meth:`generate` that needs it waits for it. Nothing is decoded. False where
        that program exists already (or nothing needs one)."""
        rows = self._rows(prompts, max_new_tokens)
        if max_new_tokens == 0:
            return False

        def ahead(signature, build):
            return self.cache.build_ahead(
                signature, lambda stages: build(stages, compile=False),
                lambda lowered, stages: stages.time("compile", lowered.compile))

        return self._program(rows, max_new_tokens, temperature, top_p, eos_token_id,
                             batch_size, ahead)[0]

    @staticmethod
    def _rows(prompts, max_new_tokens: int) -> list[list[int]]:
        rows = [[int(t) for t in row] for row in
                (prompts.tolist() if isinstance(prompts, torch.Tensor) else prompts)]
        if not rows or min(len(r) for r in rows) == 0:
            raise ValueError("prompts must be one or more non-empty lists of token ids")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        return rows

    def _program(self, rows, max_new_tokens, temperature, top_p, eos_token_id, batch_size,
                 get: Callable) -> tuple:
        """``(get(signature, build), buckets, device, model arrays, end tokens)`` for ``rows``:
        ``get`` is the cache's ``get_or_build`` (or a compile ahead)."""
        buckets = choose_buckets(max(batch_size or 0, len(rows)), max(len(r) for r in rows),
                                 max_new_tokens, self.decoding.max_length(self.model))
        eos = [] if eos_token_id is None else (
            [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        names, tensors = model_tensors(self.model)
        index = tensors[0].device.index or 0
        device = runtime.jax_device(index)
        arrays = model_arrays(names, tensors, device)
        settings = (float(temperature), float(top_p), len(eos))
        signature = self._signature(names, tensors, buckets, settings)

        def build(stages, compile: bool = True):
            return self._build(stages, names, tensors, buckets, settings,
                               torch.device("tpu", index), device, arrays, compile)

        return get(signature, build), buckets, device, arrays, eos

    def _signature(self, names, tensors, buckets: Buckets, settings) -> cache_mod.Signature:
        inputs = tuple(cache_mod.InputSpec(f'"{n}"', tuple(t.shape), t.dtype)
                       for n, t in zip(names, tensors))
        temperature, top_p, eos_count = settings
        return cache_mod.Signature(inputs, (
            ("batch bucket", buckets.batch), ("prompt bucket", buckets.prompt),
            ("new-token bucket", buckets.new), ("temperature", temperature), ("top_p", top_p),
            ("number of end tokens", eos_count), ("early stop", self.early_stop),
            ("model.training", self.model.training), ("autocast", str(self.autocast_dtype)),
            ("matmul precision", matmul_mod.get_matmul_precision())))

    def _build(self, stages: cache_mod.TimedStages, names, tensors, buckets: Buckets, settings,
               torch_device: torch.device, device, arrays, compile: bool = True):
        temperature, top_p, eos_count = settings
        wrapper = _DecodeModule(self.model, self.decoding, temperature, top_p)
        shapes = self.decoding.cache_shapes(self.model, buckets.batch, buckets.total)
        prefill, step = (stages.time("trace", _trace_step, wrapper, names, tensors, buckets,
                                     seq, shapes, torch_device, self.autocast_dtype)
                         for seq in (buckets.prompt, 1))
        stages.graph_nodes = interpreter.count_ops(prefill) + interpreter.count_ops(step)
        program = _decode_program(prefill, step, [tuple(t.shape) for t in tensors], buckets,
                                  shapes, eos_count > 0, self.early_stop)
        args = [arrays] + [jax.ShapeDtypeStruct(s, d) for s, d in (
            ((buckets.batch, buckets.prompt), jnp.int32), ((buckets.batch,), jnp.int32),
            ((buckets.batch,), jnp.bool_), ((), jnp.int32), ((eos_count,), jnp.int32))]
        args.append(jax.ShapeDtypeStruct((), jax.random.key(0).dtype))
        lowered = stages.time("lower", jax.jit(program).lower, *args)
        return stages.time("compile", lowered.compile) if compile else lowered


def _left_padded(rows: list[list[int]], buckets: Buckets):
    """(prompt ``[B, P]``, pad ``[B]``, finished ``[B]``) of the rows, left-padded with token 0;
    rows beyond ``rows`` (the batch bucket's filler) hold one token and start finished."""
    prompt = np.zeros((buckets.batch, buckets.prompt), np.int32)
    pad = np.full((buckets.batch,), buckets.prompt - 1, np.int32)
    finished = np.ones((buckets.batch,), np.bool_)
    for i, row in enumerate(rows):
        prompt[i, buckets.prompt - len(row):] = row
        pad[i] = buckets.prompt - len(row)
        finished[i] = False
    return prompt, pad, finished


def _decode_program(prefill, step, tensor_shapes, buckets: Buckets, cache_shapes,
                    has_eos: bool, early_stop: bool):
    """``program(model arrays, prompt, pad, finished, max_new, eos, key) -> (tokens
    [B, new], count)``: only ``tokens[:, :count]`` were generated."""

    def run(gm, arrays, tokens, slot, pad, caches, key):
        outputs, _ = interpreter.run_graph(gm, list(arrays) + [tokens, slot, pad] + caches,
                                           rng_key=key)
        return outputs[0].astype(jnp.int32), list(outputs[1:])

    def finish(token, finished, eos):
        # As eager generate: a finished row repeats the first end token.
        if not has_eos:
            return token, finished
        token = jnp.where(finished, eos[0], token)
        return token, finished | (token[:, None] == eos[None, :]).any(axis=-1)

    def program(flat, prompt, pad, finished, max_new, eos, key):
        arrays = [a.reshape(shape) for a, shape in zip(flat, tensor_shapes)]
        caches = [jnp.zeros(shape, storage_dtype(dtype)) for shape, dtype in cache_shapes]
        token, caches = run(prefill, arrays, prompt, jnp.int32(0), pad, caches,
                            jax.random.fold_in(key, 0))
        token, finished = finish(token, finished, eos)
        out = jnp.zeros((buckets.batch, buckets.new), jnp.int32).at[:, 0].set(token)

        def more(state):
            i, _, _, _, finished = state
            go = i < max_new
            return go & ~finished.all() if early_stop else go

        def body(state):
            i, out, token, caches, finished = state
            # The token generated last sits at slot prompt + i - 1.
            token, caches = run(step, arrays, token[:, None], buckets.prompt + i - 1, pad,
                                caches, jax.random.fold_in(key, i))
            token, finished = finish(token, finished, eos)
            out = jax.lax.dynamic_update_index_in_dim(out, token, i, axis=1)
            return i + 1, out, token, caches, finished

        count, out, *_ = jax.lax.while_loop(more, body,
                                            (jnp.int32(1), out, token, caches, finished))
        return out, count

    return program
