"""FSDP2 (``fully_shard``) on tpu tensors: storage free/alloc through the device's Storage.

FSDP2 frees an unsharded parameter after use and re-allocates it before the next all-gather
with two helpers in ``torch.distributed.fsdp._fully_shard._fsdp_param``::

    def alloc_storage(tensor):  # storage.resize_(tensor.numel() * tensor.itemsize)
    def free_storage(tensor):   # storage.resize_(0)

The unsharded parameter (and its gradient's autograd view) are views of the all-gather output
tensor, so resizing that tensor's *storage* in place is what keeps them valid across frees.
A tpu tensor is a wrapper subclass whose torch-level storage is a placeholder ("invalid python
storage": no data pointer, no resize); its data live in a :class:`~tpu_train.device.storage.Storage`
shared by all its views. So for tpu tensors the helpers swap that Storage's flat buffer for an
empty one (free) or a full-size one (alloc), keeping every view's geometry: the same effect
``resize_`` has on a real device. Other tensors go to torch's own helpers unchanged.

:func:`install_when_imported` runs on ``import tpu_train`` (``tpu_train.distributed.install``):
:func:`install` runs right away when FSDP2 is already imported, else as soon as it is (importing
FSDP2 takes most of a second, which ``import tpu_train`` does not pay for code that never
shards). It checks that the helpers it replaces are the ones it was written against (names,
signatures, the ``resize_`` calls in their source) and raises :class:`FsdpCompatError`
otherwise, rather than letting FSDP2 fail later with the unhelpful "invalid python storage"
(or silently skip a free).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys

import torch

_FSDP_PACKAGE = "torch.distributed.fsdp._fully_shard"
_HELPER_MODULE = _FSDP_PACKAGE + "._fsdp_param"
# Modules of the package known to import the helpers by name (their own global binding must
# be replaced too). Any other module of the package holding them is found by scanning.
_IMPORTERS = ("_fsdp_param_group",)

_state: dict = {"installed": False, "original": {}}


class FsdpCompatError(RuntimeError):
    """torch's FSDP2 internals changed in a way this adaptation does not know."""


def _storage_extent(tensor) -> int:
    """Elements of the flat buffer the tensor's geometry reaches (0 for an empty tensor)."""
    if tensor.numel() == 0:
        return 0
    return tensor.storage_offset() + 1 + sum(
        (n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))


def alloc_storage(tensor: torch.Tensor) -> None:
    """Give ``tensor``'s storage room for the tensor again (FSDP2's ``alloc_storage``).

    Contents are unspecified after a free, as with ``resize_``: FSDP2 overwrites them with
    the all-gather result. A storage that still holds data keeps its prefix when grown.
    """
    from tpu_train.device.tensor import TpuTensor, storage_of

    if not isinstance(tensor, TpuTensor):
        return _state["original"]["alloc_storage"](tensor)
    storage_of(tensor).resize(_storage_extent(tensor))
    return None


def free_storage(tensor: torch.Tensor) -> None:
    """Drop ``tensor``'s device memory, keeping its geometry (FSDP2's ``free_storage``)."""
    from tpu_train.device.tensor import TpuTensor, storage_of

    if not isinstance(tensor, TpuTensor):
        return _state["original"]["free_storage"](tensor)
    storage_of(tensor).resize(0)
    return None


# -- FSDP2's own ops (``torch.ops.fsdp.*``) -----------------------------------------------------
# torch registers them for PrivateUse1 as Python kernels made of other torch ops; those kernels
# run below the Python dispatch key, where a tpu tensor has no kernels. So they are handled in
# the device layer's special-op table instead, with the same semantics written for flat buffers.


def _all_gather_copy_in(func, args, kwargs):
    """Copy this rank's inputs into its slot of the all-gather output, in one write."""
    bound = _bind(func, args, kwargs)
    inputs, output = bound["all_gather_inputs"], bound["all_gather_output"]
    numel, rank = int(bound["all_gather_input_numel"]), int(bound["rank"])
    slot = output.narrow(0, numel * rank, numel)
    sizes = [int(s) for s in bound["inp_split_sizes"]]
    if sum(sizes) != numel or [t.numel() for t in inputs] != sizes:
        raise RuntimeError(f"fsdp.all_gather_copy_in: input sizes {[t.numel() for t in inputs]} "
                           f"do not fill the {numel}-element slot as split {sizes}")
    flat = torch.cat([_cast(dense(t).view(-1), output.dtype) for t in inputs]) if inputs else None
    if flat is not None:
        slot.copy_(flat)
    return slot, output


def _split_with_sizes_copy(func, args, kwargs):
    """Copy the pieces of ``all_gather_output`` split along ``dim`` into ``out``."""
    bound = _bind(func, args, kwargs)
    source, out = bound["all_gather_output"], bound["out"]
    pieces = torch.split(source, [int(s) for s in bound["all_gather_input_split_sizes"]],
                         dim=bound["dim"])
    if len(pieces) != len(out):
        raise RuntimeError(f"fsdp.split_with_sizes_copy: {len(pieces)} pieces, {len(out)} outputs")
    for piece, destination in zip(pieces, out):
        destination.copy_(piece)


def _chunk_cat(func, args, kwargs):
    """``out[c]`` = concatenation of every tensor's c-th dim-0 chunk (zero-padded), flattened."""
    bound = _bind(func, args, kwargs)
    tensors, dim, chunks, out = bound["tensors"], bound["dim"], bound["num_chunks"], bound["out"]
    if dim != 0:
        raise NotImplementedError(f"fsdp.chunk_cat along dim {dim} on tpu tensors (FSDP2 uses 0)")
    rows = []
    for tensor in tensors:
        length = tensor.shape[0] if tensor.dim() else 1
        padded_length = -(-length // chunks) * chunks
        flat = dense(tensor).view(length, -1)
        if padded_length != length:
            flat = torch.cat([flat, flat.new_zeros(padded_length - length, flat.shape[1])])
        rows.append(_cast(flat.view(chunks, -1), out.dtype))
    out.copy_(torch.cat(rows, dim=1).view(out.shape))


def dense(tensor):
    from tpu_train.distributed.functional import dense as _dense

    return _dense(tensor)


def _cast(tensor, dtype):
    # Inside __torch_dispatch__ the composite ``Tensor.to`` arrives as ``aten.to.dtype`` (a
    # "may alias" op); the copy op it stands for is called directly, whatever the device layer
    # does with the composite.
    if tensor.dtype == dtype:
        return tensor
    return torch.ops.aten._to_copy.default(tensor, dtype=dtype)


def _bind(func, args, kwargs) -> dict:
    from tpu_train.device.mutation import bind_arguments

    return bind_arguments(func, args, kwargs)


_FSDP_OPS = {
    "all_gather_copy_in": (_all_gather_copy_in,
                           ["all_gather_inputs", "all_gather_output", "inp_split_sizes",
                            "all_gather_input_numel", "rank"]),
    "split_with_sizes_copy": (_split_with_sizes_copy,
                              ["all_gather_output", "all_gather_input_split_sizes", "dim", "out"]),
    "chunk_cat": (_chunk_cat, ["tensors", "dim", "num_chunks", "out"]),
}


def _install_op_handlers() -> None:
    from tpu_train.device import special_ops

    for name, (handler, expected) in _FSDP_OPS.items():
        packet = getattr(torch.ops.fsdp, name, None)
        op = getattr(packet, "default", None) if packet is not None else None
        if op is None:
            raise FsdpCompatError(f"torch.ops.fsdp.{name} is gone in torch {torch.__version__}; "
                                  "tpu_train.distributed.fsdp_compat must be updated")
        arguments = [a.name for a in op._schema.arguments]
        if arguments != expected:
            raise FsdpCompatError(
                f"torch.ops.fsdp.{name} now takes {arguments} (expected {expected}) in torch "
                f"{torch.__version__}; tpu_train.distributed.fsdp_compat must be updated")
        special_ops.HANDLERS.setdefault(op, handler)


def _check_helper(module, name: str) -> None:
    """Fail loudly unless ``module.name`` is the resize-based helper this file replaces."""
    helper = getattr(module, name, None)
    if helper is None:
        raise FsdpCompatError(
            f"{module.__name__}.{name} no longer exists in torch {torch.__version__}: FSDP2 "
            "frees unsharded parameters some other way; tpu_train.distributed.fsdp_compat "
            "must be updated before fully_shard can run on tpu tensors")
    params = list(inspect.signature(helper).parameters)
    try:
        source = inspect.getsource(helper)
    except (OSError, TypeError):
        source = None
    expected_resize = "resize_(size)" if name == "alloc_storage" else "resize_(0)"
    if params != ["tensor"] or (source is not None and (
            "untyped_storage()" not in source or expected_resize not in source)):
        raise FsdpCompatError(
            f"{module.__name__}.{name} changed in torch {torch.__version__} (parameters "
            f"{params}); tpu_train.distributed.fsdp_compat was written for "
            f"`def {name}(tensor)` resizing tensor.untyped_storage() and must be reviewed")


def install() -> None:
    """Route FSDP2's storage free/alloc through the tpu Storage (idempotent).

    Raises :class:`FsdpCompatError` when the helpers are not the expected ones.
    """
    if _state["installed"]:
        return
    import importlib

    helpers = importlib.import_module(_HELPER_MODULE)
    for name in ("alloc_storage", "free_storage"):
        _check_helper(helpers, name)
    for name in _IMPORTERS:
        importlib.import_module(f"{_FSDP_PACKAGE}.{name}")
    importlib.import_module(f"{_FSDP_PACKAGE}._fsdp_collectives")  # defines torch.ops.fsdp
    _install_op_handlers()
    replacements = {"alloc_storage": alloc_storage, "free_storage": free_storage}
    originals = {name: getattr(helpers, name) for name in replacements}
    # Every module of the package bound to an original helper gets the replacement: a module
    # that did `from ._fsdp_param import alloc_storage` holds its own reference.
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(_FSDP_PACKAGE):
            continue
        for name, replacement in replacements.items():
            if getattr(module, name, None) is originals[name]:
                setattr(module, name, replacement)
    _state["original"] = originals
    _state["installed"] = True


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Finds FSDP2's package like the standard path finder, then runs :func:`install` once
    the package's module has executed (its submodules, holding the helpers, are loaded then)."""

    def find_spec(self, name, path, target=None):
        if name != _FSDP_PACKAGE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def execute_then_install(module):
            execute(module)
            install()

        spec.loader.exec_module = execute_then_install
        return spec


def install_when_imported() -> None:
    """:func:`install` now when FSDP2 is imported, else right after it is (idempotent)."""
    if _FSDP_PACKAGE in sys.modules:
        install()
    elif not any(isinstance(finder, _InstallAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterImport())


def installed() -> bool:
    return _state["installed"]
