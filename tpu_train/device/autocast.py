"""``torch.autocast("tpu", ...)``: mixed precision on the ``tpu`` device, eager and compiled.

PyTorch routes every op on a PrivateUse1 tensor through the ``AutocastPrivateUse1`` dispatch
key while ``torch.autocast`` is active for that device, but ships no kernels for it: a
backend has to register them (without any, the first op under autocast fails with "Could not
run ... with arguments from the 'Autocasttpu' backend"). :func:`register` installs

* a fallthrough for every op, so ops without an autocast rule run unchanged;
* Python kernels for three op families, with the policies CUDA autocast uses:

  - **lower precision** (matmuls, convolutions, attention): floating ``tpu`` tensor
    arguments are cast to the autocast dtype (``torch.get_autocast_dtype("tpu")``);
  - **float32** (reductions, norms, losses, softmax, transcendental functions that lose
    accuracy in 16 bits): floating arguments are cast up to float32;
  - **promote** (ops that combine several tensors, e.g. ``cat``): floating arguments are cast
    to the widest floating dtype among them.

float64 tensors and tensors on other devices are never cast, as in PyTorch.

The kernels cast under an exclusion of the autocast key and then call the op again, so the
casts are ordinary ``_to_copy`` ops: in eager mode they run like any other op, under
``make_fx`` they are traced into the graph (that is how ``compile_train_step(...,
autocast_dtype=torch.bfloat16)`` gets a mixed-precision program: see
``tpu_train.compile.lowering.autocast_region``) and autograd
differentiates through them (gradients of float32 parameters stay float32).

Unlike CUDA autocast there is no cache of cast weights: each use of a float32 parameter in
an autocast region casts it again. In a compiled step XLA merges the repeated casts; in
eager mode they cost one extra elementwise op per use.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch.utils._pytree import tree_map

__all__ = ["DEVICE_TYPE", "register", "LOWER_PRECISION_OPS", "FLOAT32_OPS", "PROMOTE_OPS"]

DEVICE_TYPE = "tpu"

# Ops whose inputs autocast casts to the lower-precision dtype: the matmul-bound ops that
# gain from bf16 and keep float32 accumulation inside (tpu_train.ops.matmul).
LOWER_PRECISION_OPS = (
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "_convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "linalg_vecdot", "scaled_dot_product_attention",
)

# Ops that run in float32 under autocast: reductions and normalisations whose accuracy
# suffers in 16 bits, losses, and functions with a large dynamic range.
FLOAT32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "rms_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "nll_loss_nd",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum", "norm",
    "cross_entropy_loss",
)

# Ops that combine several tensors: they run in the widest floating dtype among them.
PROMOTE_OPS = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add", "cat", "stack",
)

_LOWER, _FLOAT32, _PROMOTE = "lower", "float32", "promote"
_KEY = "AutocastPrivateUse1"
_lock = threading.Lock()
_libraries: list = []  # keep the registrations alive (a dropped Library unregisters)


def _eligible(value) -> bool:
    """A tensor autocast may cast: floating, on the tpu device, not float64."""
    return (isinstance(value, torch.Tensor) and value.is_floating_point()
            and value.device.type == DEVICE_TYPE and value.dtype != torch.float64)


def _kernel(op, policy: str):
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    @functools.wraps(op)
    def kernel(*args, **kwargs):
        # Exclude the autocast key first, so the casts below and the op itself run without
        # autocast (the op's own inner ops must not be cast again).
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            if policy == _LOWER:
                dtype = torch.get_autocast_dtype(DEVICE_TYPE)
            elif policy == _FLOAT32:
                dtype = torch.float32
            else:
                dtype = None
                for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
                    if _eligible(leaf):
                        dtype = leaf.dtype if dtype is None else torch.promote_types(dtype, leaf.dtype)
                if dtype is None:
                    return op(*args, **kwargs)

            def cast(value):
                return value.to(dtype) if _eligible(value) and value.dtype != dtype else value

            return op(*tree_map(cast, args), **tree_map(cast, kwargs))

    return kernel


def _overloads(name: str):
    """The functional overloads of ``aten.<name>`` (autocast does not apply to ``out=``)."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:  # an op this PyTorch version does not have
        return
    for overload in packet.overloads():
        if "out" in overload.split("_"):
            continue
        yield overload, getattr(packet, overload)


def register() -> None:
    """Install the autocast kernels for the ``tpu`` device (idempotent, thread-safe)."""
    with _lock:
        if _libraries:
            return
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(torch.library.fallthrough_kernel, _KEY)
        kernels = torch.library.Library("aten", "IMPL")
        for policy, names in ((_LOWER, LOWER_PRECISION_OPS), (_FLOAT32, FLOAT32_OPS),
                              (_PROMOTE, PROMOTE_OPS)):
            for name in names:
                for overload, op in _overloads(name):
                    qualified = name if overload == "default" else f"{name}.{overload}"
                    kernels.impl(qualified, _kernel(op, policy), _KEY)
        _libraries.extend([fallback, kernels])

