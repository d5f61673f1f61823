"""Eager execution of ATen ops on tpu tensors.

Every op reaching :meth:`TpuTensor.__torch_dispatch__` is routed here:

1. a few ops with device semantics of their own (``copy_``, ``_to_copy``, ``.item()``, ...)
   are handled in :mod:`tpu_train.device.special_ops`;
2. *view* ops only compute geometry (torch's meta kernels do it) and return a tensor sharing
   the base's storage — so writes through views are seen everywhere, as on a real device;
3. *mutating* ops (in-place, ``out=``) run their functional counterpart's lowering and write the
   result through the mutated tensors' geometry, in one executable
   (:mod:`tpu_train.device.op_cache`; the general path is :mod:`tpu_train.device.mutation`);
4. functional ops run their lowering from :mod:`tpu_train.ops`, each as a cached ``jax.jit``
   that reads its inputs' views and flattens its outputs; output shapes and dtypes come from
   torch's meta kernels, so torch's type promotion and shape errors hold exactly;
5. ops without a lowering use torch's decompositions, then the CPU fallback when
   ``TPU_TRAIN_CPU_FALLBACK=1``, else raise ``NotImplementedError`` naming the op.

Views, mutating and functional ops go through the per-call cache of
:mod:`tpu_train.device.op_cache`: one key per call, and a repeated call is one dictionary look-up
and one XLA dispatch. What kind an op is gets worked out once per op (``op_cache.op_info``).

Dispatch is asynchronous (JAX's own): nothing waits for the device unless a value is read.
Strict mode records a backward pass's ops and a run of multi-tensor ops (an optimizer's step)
and runs them as one program before the next other op (``lazy.batch_backward``,
``lazy.batch_multi_tensor``).
``TPU_TRAIN_SYNC=1`` waits after every op so that an error points at the op that caused it.
"""

from __future__ import annotations

import torch

from tpu_train.device import fallback, inplace, lazy, op_cache, special_ops
from tpu_train.device.meta import device_index_of, meta_outputs, to_meta  # noqa: F401 (API)
from tpu_train.device.op_cache import SYNC_ENV  # noqa: F401 (API)

aten = torch.ops.aten

_HANDLERS = special_ops.HANDLERS  # other layers add handlers to this dict at import
_HANDLERS_BY_NAME = special_ops.HANDLERS_BY_NAME
_INFO = op_cache._INFO


def dispatch(func, args, kwargs):
    if lazy.deferred and not lazy.active:
        _run_deferred_before(func)
    handler = _HANDLERS.get(func)
    if handler is not None:
        return handler(func, args, kwargs)
    info = _INFO.get(func)
    if info is None:  # the op's first call
        handler = _HANDLERS_BY_NAME.pop(str(func), None)
        if handler is not None:
            _HANDLERS[func] = handler
            return handler(func, args, kwargs)
        info = op_cache.op_info(func)
    kind = info.kind
    if kind is op_cache.LOWERED:
        return op_cache.run_lowered(info, func, args, kwargs)
    if kind is op_cache.VIEW:
        return op_cache.run_view(info, func, args, kwargs)
    if kind is op_cache.MUTATING:
        return inplace.run_mutating(info, func, args, kwargs)
    if kind is op_cache.INPLACE_VIEW:
        return special_ops.inplace_view(func, args, kwargs)
    if kind is op_cache.COMPOSITE_VIEW:
        # "May alias" ops such as to.dtype or reshape: their composite kernel decides
        # whether the result is a view or a copy.
        result = func.decompose(*args, **kwargs)
        if result is not NotImplemented:
            return result
        return op_cache.run_view(info, func, args, kwargs)
    return fallback.run_without_lowering(func, args, kwargs)


def _run_deferred_before(func) -> None:
    """Strict mode: run the recorded multi-tensor ops (``lazy.batch_multi_tensor``) before any
    other op."""
    info = _INFO.get(func)
    if info is None or not op_cache.batch or not (info.multi_tensor or lazy.records_backward()):
        lazy.flush_all()
