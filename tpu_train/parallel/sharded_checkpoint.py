"""Sharded checkpoints of a compiled SPMD step, restorable onto another layout.

``save_sharded(path, step)`` writes the step's parameters, optimizer state and step counts in
the ``torch.distributed.checkpoint`` (DCP) format: every process writes only the shards that
live on its own devices (each distinct shard once, by the device holding replica 0), and the
metadata records where each chunk sits in the global tensor. ``load_sharded(path, step)``
reads, for each of this process's devices, exactly the slice its *current* sharding needs;
DCP's resharding computes which saved chunks overlap it. So a checkpoint saved under FSDP=8
restores onto TP=2 x FSDP=4, or onto another number of processes.

Tensors are saved as their flat storage buffers (the ``tpu`` device keeps every storage as one
flat array in row-major order), so a chunk is a contiguous range of elements whatever the
mesh: the layout of the saving job is not part of the format.

Saving is atomic: all processes write into ``<path>.tmp``; once DCP has written the metadata
(after every process finished its files), process 0 renames it to ``path``. A crash leaves
either the previous state or a complete checkpoint, never a partial one under ``path``.
A ``path`` that is a URL (``gs://...``: an object store, without rename) is written in place
through fsspec (DCP's ``FsspecWriter``); the caller marks it complete (the trainer's
``meta.json``, written last).

Trust model: loading reads two kinds of files. The shard files are read by DCP with
``torch.load(weights_only=True)`` (tensors only, no code). The ``.metadata`` file is a pickle,
which DCP's own ``FileSystemReader`` unpickles with the unrestricted :mod:`pickle` — a crafted
file would run arbitrary code. :func:`load_sharded` reads it with a restricted unpickler
instead (:class:`SafeFileSystemReader`): only DCP's metadata classes, ``torch.Size``, torch
dtypes and layouts, paths and a few plain containers may be named; anything else (``os.system``,
``builtins.eval``, ...) is refused with :class:`UnsafeCheckpointError` before it is built. A
checkpoint directory still deserves the trust one gives to data, not to code: the restriction
guarantees that loading executes nothing, not that the values are sensible (the trainer checks
the SHA-256 sums recorded in ``meta.json`` before it loads).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tpu_train.device import TpuTensor, owns_whole_storage, storage_of

__all__ = ["SafeFileSystemReader", "UnsafeCheckpointError", "load_sharded",
           "read_metadata_safely", "save_sharded", "step_state"]


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A sharded checkpoint's ``.metadata`` names something other than DCP metadata."""


# What a DCP ``.metadata`` pickle may name (module -> names); torch dtypes are checked apart.
_ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "MetadataIndex", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath",
                          "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and refuses every other global (so nothing is executed)."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.source}: refusing to load {module}.{name} (a sharded checkpoint's metadata "
            "may only name torch.distributed.checkpoint metadata classes, torch.Size and "
            "dtypes); the file is corrupt or crafted, do not load it")


def read_metadata_safely(path: str | os.PathLike):
    """The DCP ``Metadata`` of checkpoint directory ``path`` (or of the metadata file
    ``path`` itself), read with the restricted unpickler."""
    source = Path(path) / ".metadata" if Path(path).is_dir() else Path(path)
    return _unpickle_metadata(source.read_bytes(), str(source))


def _unpickle_metadata(data: bytes, source: str):
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), str(source)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated or garbage bytes
        raise UnsafeCheckpointError(f"{source}: not a readable checkpoint metadata file "
                                    f"({type(exc).__name__}: {exc})") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{source}: holds a {type(metadata).__name__}, not DCP "
                                    "Metadata")
    return metadata


class _SafeMetadata:
    """``read_metadata`` by the restricted unpickler, for DCP's file readers."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _unpickle_metadata(stream.read(), str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, dcp.FileSystemReader):
    """DCP's ``FileSystemReader`` with ``.metadata`` read by the restricted unpickler."""


def _at_url(path) -> bool:
    """A URL other than ``file://`` (``str()`` of a ``upath.UPath`` is its URL)."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


def _fsspec_io():
    """DCP's fsspec reader and writer. torch ships them in this module only (it is where
    ``dcp.save(checkpoint_id=URL)`` finds them too)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    class SafeFsspecReader(_SafeMetadata, FsspecReader):
        """DCP's ``FsspecReader`` with ``.metadata`` read by the restricted unpickler."""

    return SafeFsspecReader, FsspecWriter

_STEP_KEY = "optimizer.group{}.step"


def _storage(tensor):
    if not isinstance(tensor, TpuTensor) or not owns_whole_storage(tensor):
        raise ValueError("sharded checkpoints need tpu tensors that own their whole storage "
                         "(place the step with place_for_step first)")
    return storage_of(tensor)


def step_state(step: Any) -> dict[str, Any]:
    """``{key: storage}`` of a compiled step's parameters and optimizer moments, by name."""
    names = {id(p): n for n, p in step.model.named_parameters(remove_duplicate=False)}
    state: dict[str, Any] = {}
    for p in step.model.parameters():
        state[f"model.{names[id(p)]}"] = _storage(p)
    for group in step.optimizer.param_groups:
        for p in group["params"]:
            if p not in step.optimizer.state:
                continue
            for key in step.adapter.state_keys_for(group):
                state[f"optimizer.{names[id(p)]}.{key}"] = _storage(step.optimizer.state[p][key])
    return state


def _torch_dtype(np_dtype) -> torch.dtype:
    if np_dtype == jax.numpy.bfloat16:
        return torch.bfloat16
    return torch.from_numpy(np.zeros((), np_dtype)).dtype


def _to_torch(array) -> torch.Tensor:
    host = np.asarray(array)
    if host.dtype == jax.numpy.bfloat16:  # numpy has no bfloat16: go through the bits
        return torch.from_numpy(host.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(host.copy())


def _to_numpy(tensor: torch.Tensor, np_dtype) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy().view(np_dtype)
    return tensor.numpy().astype(np_dtype, copy=False)


def _offsets(index, shape) -> tuple[int, ...]:
    return tuple(0 if s.start is None else int(s.start) for s, _ in zip(index, shape))


class _ShardSavePlanner(DefaultSavePlanner):
    """Writes each process's own distinct shards of global jax arrays, plain tensors once."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, value in self.state_dict.items():
            if isinstance(value, torch.Tensor):
                if self.is_coordinator:  # small values (step counts): written once
                    offsets = torch.Size([0] * value.dim())
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, offsets), type=WriteItemType.TENSOR,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets, value.size()),
                            properties=TensorProperties.create_from_tensor(value),
                            size=value.size())))
                continue
            for shard in value.addressable_shards:
                if shard.replica_id != 0:  # another device (maybe another process) writes it
                    continue
                offsets = torch.Size(_offsets(shard.index, value.shape))
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets, torch.Size(shard.data.shape)),
                        properties=TensorProperties(dtype=_torch_dtype(value.dtype)),
                        size=torch.Size(value.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        value = self.state_dict[write_item.index.fqn]
        if isinstance(value, torch.Tensor):
            return value
        for shard in value.addressable_shards:
            if shard.replica_id == 0 and \
                    _offsets(shard.index, value.shape) == tuple(write_item.index.offset):
                return _to_torch(shard.data)
        raise KeyError(write_item.index)


class _ShardLoadPlanner(DefaultLoadPlanner):
    """Reads, into host buffers, the distinct shards this process's target arrays need."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # The default set-up initializes tensor-like values in place; ours are jax arrays
        # (targets to read the layout from), kept as they are.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for fqn, value in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                raise ValueError(f"the checkpoint has no {fqn!r} (saved from another model or "
                                 "optimizer?)")
            shape = tuple(value.shape)
            if tuple(md.size) != shape:
                raise ValueError(f"{fqn}: the checkpoint holds shape {tuple(md.size)}, the "
                                 f"target has {shape}")
            if isinstance(value, torch.Tensor):
                chunks = [(tuple([0] * value.dim()), shape)]
                dtype = value.dtype
            else:
                chunks = {(_offsets(s.index, shape), tuple(s.data.shape))
                          for s in value.addressable_shards}
                dtype = _torch_dtype(value.dtype)
            local = []
            for offsets, sizes in sorted(chunks):
                self.buffers[(fqn, offsets)] = torch.empty(sizes, dtype=dtype)
                local.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            requests += create_read_items_for_chunk_list(fqn, md, local)
        return LoadPlan(requests)

    def resolve_tensor(self, read_item):
        buffer = self.buffers[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            buffer = buffer.narrow(dim, start, length)
        return buffer

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor handed out a view of the buffer: the data is already there


def _coordination_group():
    """A gloo group for DCP's small metadata exchanges (None in a one-process job)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


def save_sharded(path: str | os.PathLike, step: Any) -> Path:
    """Write ``step``'s parameters, optimizer state and step counts to directory ``path``.

    Every process of the job calls it; each writes only its devices' shards. Returns ``path``.
    """
    step.settle()  # step counts of a skipped last update put back
    state: dict[str, Any] = {k: s.buffer for k, s in step_state(step).items()}
    for i, group in enumerate(step.optimizer.param_groups):
        state[_STEP_KEY.format(i)] = torch.tensor([step.adapter.step_count(group)])
    group = _coordination_group()
    if _at_url(path):
        return _save_at_url(str(path), state, group)
    path = Path(path)
    rank = dist.get_rank() if group is not None else 0
    tmp = path.with_name(path.name + ".tmp")
    if path.exists():  # every process checks (shared storage), so none waits for a failed one
        raise FileExistsError(f"{path} exists: a checkpoint directory is written once")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died before its rename
    if group is not None:
        dist.barrier(group=group)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
             planner=_ShardSavePlanner(), process_group=group)
    if rank == 0:
        os.replace(tmp, path)
    if group is not None:
        dist.barrier(group=group)  # nobody goes on before the checkpoint exists under path
        dist.destroy_process_group(group)
    return path


def _save_at_url(url: str, state: dict, group) -> str:
    """:func:`save_sharded` into an object store: in place (no rename there)."""
    from fsspec.core import url_to_fs

    _, writer = _fsspec_io()
    fs, root = url_to_fs(url)
    if fs.exists(f"{root}/.metadata"):
        raise FileExistsError(f"{url} exists: a checkpoint directory is written once")
    # No fsync: an object is stored once its upload completes (fsync of such a stream would
    # fall back to syncing the whole local disk).
    dcp.save(state, storage_writer=writer(url, sync_files=False), planner=_ShardSavePlanner(),
             process_group=group)
    if group is not None:
        dist.barrier(group=group)
        dist.destroy_process_group(group)
    return url


def _reader(path: Any):
    """The restricted DCP reader of checkpoint ``path`` (a local directory or a URL)."""
    if _at_url(path):
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(str(path))
        if not fs.isfile(f"{root}/.metadata"):
            raise FileNotFoundError(f"{path} is not a sharded checkpoint (no .metadata)")
        return _fsspec_io()[0](str(path))
    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a sharded checkpoint (no .metadata)")
    return SafeFileSystemReader(Path(path))


def load_sharded(path: str | os.PathLike, step: Any) -> None:
    """Restore a :func:`save_sharded` checkpoint into ``step`` *in its current layout*.

    Place the step first (:func:`~tpu_train.parallel.place_for_step`, on the mesh and plan to
    restore onto); every storage keeps its sharding and receives the saved values. The
    ``.metadata`` pickle is read by a restricted unpickler (module docstring: trust model);
    :class:`UnsafeCheckpointError` when it names anything but DCP metadata.
    """
    reader = _reader(path)
    step.settle()  # nothing left to put back over the counts loaded here
    storages = step_state(step)
    state: dict[str, Any] = {k: s.buffer for k, s in storages.items()}
    groups = step.optimizer.param_groups
    for i in range(len(groups)):
        state[_STEP_KEY.format(i)] = torch.zeros(1, dtype=torch.int64)
    planner = _ShardLoadPlanner()
    group = _coordination_group()
    dcp.load(state, storage_reader=reader, planner=planner, process_group=group)
    if group is not None:
        dist.destroy_process_group(group)
    for key, storage in storages.items():
        target = storage.buffer
        arrays = []
        for shard in target.addressable_shards:
            host = planner.buffers[(key, _offsets(shard.index, target.shape))]
            arrays.append(jax.device_put(_to_numpy(host, target.dtype), shard.device))
        storage.buffer = jax.make_array_from_single_device_arrays(
            target.shape, target.sharding, arrays)
    for i, g in enumerate(groups):
        step.adapter.set_step_count(g, int(planner.buffers[(_STEP_KEY.format(i), (0,))][0]))
