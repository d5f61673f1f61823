"""Let torch's c10d ops on ``tpu`` tensors reach the ProcessGroup.

``ProcessGroup`` methods implemented in C++ (``all_gather_single``, functional collectives,
``wait_tensor``, ...) call dispatcher ops in the ``c10d`` / ``_c10d_functional`` namespaces. With a
tpu tensor argument these first enter ``TpuTensor.__torch_dispatch__``, where they have no
lowering. Their real kernels are registered for PrivateUse1 (and CompositeExplicitAutograd):
they look up the group's backend for the tensor's device and call our Python methods. So the
device layer's special-op table gets one handler for every such op that simply runs the op
again below the Python dispatch key, except the functional collectives, whose C++ kernels
allocate and copy tensors: :mod:`.functional` implements those in Python.
"""

from __future__ import annotations

import torch

_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def _below_python_key(func, args, kwargs):
    with torch._C._DisableTorchDispatch():
        return func(*args, **kwargs)


def collective_ops() -> list:
    """Every overload of every op in torch's collective namespaces."""
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, op_name = name.partition("::")
        if namespace not in _NAMESPACES:
            continue
        packet = getattr(getattr(torch.ops, namespace), op_name)
        found += [getattr(packet, overload) for overload in packet.overloads()]
    return found


def install() -> None:
    """Route the collective ops around the lowering table (idempotent)."""
    from tpu_train.device import special_ops
    from tpu_train.distributed.functional import HANDLERS, HANDLERS_BY_NAME

    for op, handler in HANDLERS.items():
        special_ops.HANDLERS.setdefault(op, handler)
    for name, handler in HANDLERS_BY_NAME.items():
        special_ops.HANDLERS_BY_NAME.setdefault(name, handler)
    for op in collective_ops():
        special_ops.HANDLERS.setdefault(op, _below_python_key)
