"""Streaming packing of samples into fixed-length training sequences, resumable exactly.

Samples (``<bos> ... <eos>``) are concatenated into one token stream which is cut into rows of
``seq_len + 1`` tokens; consecutive rows overlap by one token so no next-token transition is
lost. A row gives ``tokens = row[:-1]`` and ``labels = row[1:]`` with ``-100`` wherever the
predicted token is not a target (prompt tokens, ``<bos>``, padding). The first token of every
sample is never a target, so the label of a sample's last token (the next sample's first) is
always ``-100``: the loss never crosses a sample boundary.

With ``document_masking`` a batch also holds, per token, ``segment_ids`` (which sample of its
row it belongs to, counting from 1 in each row) and ``position_ids`` (its position within that
sample, restarting at 0 where a sample starts and at the start of every row). A model given
them attends only within a sample (causal and same segment) and rotates by the per-sample
positions, so each sample is computed as if it were alone in its row. Padding at the end of a
last row is one more segment of its own.

Memory is bounded by the packing buffer (about one row plus one sample), the optional shuffle
buffer (``shuffle_buffer`` samples) and one chunk of read-ahead records; files are streamed.

With ``weights`` the samples come from a mixture of the files (see
:class:`~tpu_train.data.streams.MixtureStream`) instead of from the files in order.

The loader's ``state_dict()`` holds everything the future depends on: the file position just
after the last sample taken (one per file for a mixture, with the mixture's RNG), the epoch, the
packing buffer, the shuffle buffer and the shuffle RNG. A new loader given that state yields
exactly the batches the old one would have.
"""

from __future__ import annotations

import array
import random
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from tpu_train.data.datasets import Sample, check_format
from tpu_train.data.errors import DataError
from tpu_train.data.sources import DataFiles, check_sources
from tpu_train.data.streams import FileStream, MixtureStream, rng_from_state, rng_state
from tpu_train.data.tokenizer import Tokenizer, load_tokenizer

IGNORE_INDEX = -100
STATE_VERSION = 1


def resolve_tokenizer(tokenizer: Tokenizer | str | Path | None) -> Tokenizer:
    """A ``Tokenizer`` as is, or loaded from a path; ``None`` is an error (say which to use)."""
    if tokenizer is None:
        raise DataError(
            "no tokenizer given; pass a Tokenizer or a tokenizer path (load_tokenizer() loads the "
            "bundled default)"
        )
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    return load_tokenizer(tokenizer)


def rows_to_batch(rows: Sequence[tuple[list[int], list[bool]]],
                  starts: Sequence[list[bool]] | None = None) -> dict[str, torch.Tensor]:
    """``{"tokens", "labels"}`` LongTensors from rows of ``seq_len + 1`` ids and target flags;
    with ``starts`` (per row, True at the first token of a sample) also ``segment_ids`` and
    ``position_ids`` (module docstring)."""
    width = len(rows[0][0])
    # array.array copies a list of ints in C, several times faster than torch.tensor(list).
    flat_ids, flat_targets = array.array("q"), array.array("b")
    for row_ids, row_targets in rows:
        flat_ids.fromlist(row_ids)
        flat_targets.fromlist(row_targets)
    ids = torch.frombuffer(flat_ids, dtype=torch.long).view(len(rows), width).clone()
    targets = torch.frombuffer(flat_targets, dtype=torch.int8).view(len(rows), width).bool()
    labels = torch.where(targets[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE_INDEX))
    batch = {"tokens": ids[:, :-1].contiguous(), "labels": labels}
    if starts is not None:
        batch.update(segments_and_positions(starts, width - 1))
    return batch


def segments_and_positions(starts: Sequence[list[bool]], seq_len: int) -> dict[str, torch.Tensor]:
    """``segment_ids`` and ``position_ids`` ``[B, seq_len]`` (int64) of the first ``seq_len``
    tokens of rows whose sample starts are flagged in ``starts``; a row's first token always
    starts a segment (a sample continued from the previous row restarts at position 0)."""
    flat = array.array("b")
    for row in starts:
        flat.fromlist([bool(s) for s in row[:seq_len]])
    first = torch.frombuffer(flat, dtype=torch.int8).view(len(starts), seq_len).bool().clone()
    first[:, 0] = True
    index = torch.arange(seq_len).expand(len(starts), seq_len)
    last_start = torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values
    return {"segment_ids": first.long().cumsum(dim=1), "position_ids": index - last_start}


class PackedLoader:
    """Iterator of packed batches ``{"tokens": [B, S], "labels": [B, S]}`` (CPU int64).

    The loader is one stream: ``iter(loader)`` returns the loader itself and every batch taken
    (``next``, a ``for`` loop, a probe) advances it. For repeated evaluation passes build a new
    loader per pass (with ``num_epochs=1``).

    Args:
        paths: one data file or several (read in order, every epoch), or a ``DataFiles``; any
            kind :mod:`tpu_train.data.sources` reads (JSONL, text, JSON, Parquet, saved).
        tokenizer: a :class:`Tokenizer` or a path for :func:`load_tokenizer`.
        seq_len: tokens per row (``S``).
        batch_size: rows per batch (``B``).
        format: ``"auto"`` (per record), ``"text"``, ``"instruction"`` or ``"chat"``.
        mask_prompt: exclude prompt tokens from the loss (``labels == -100``).
        shuffle_buffer: 0 for file order, else sample from a buffer of this many samples.
        seed: seeds the shuffle buffer and the mixture.
        num_epochs: ``None`` to cycle forever; else stop after this many passes.
        drop_last: at the end of the last epoch, drop the partial row and partial batch
            (otherwise the row is padded and the short batch is yielded).
        read_chunk: records parsed and tokenized per read-ahead (speed only; not in the state).
        weights: ``None`` to read the files in order; else one positive weight per file: each
            sample comes from file ``i`` with probability ``weights[i] / sum(weights)`` and
            every file cycles on its own (needs ``num_epochs=None``).
        column_map: our field name -> the files' column (e.g. ``{"prompt": "question"}``).
        document_masking: batches also hold ``segment_ids`` and ``position_ids`` (module
            docstring), so that a model attends within each sample only.
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path] | DataFiles,
        tokenizer: Tokenizer | str | Path | None,
        seq_len: int,
        batch_size: int,
        *,
        format: str = "auto",
        mask_prompt: bool = True,
        shuffle_buffer: int = 0,
        seed: int = 0,
        num_epochs: int | None = None,
        drop_last: bool = True,
        read_chunk: int = 256,
        weights: Sequence[float] | None = None,
        column_map: Mapping[str, str] | None = None,
        document_masking: bool = False,
    ):
        self.files = DataFiles.of(paths, column_map)
        check_sources(self.files)
        self.paths = list(self.files.paths)
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got seq_len={seq_len}, batch_size={batch_size}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be None (forever) or >= 1, got {num_epochs}")
        if weights is not None and num_epochs is not None:
            raise ValueError("a mixture (weights) cycles every file forever; num_epochs must be None")
        self.tokenizer = resolve_tokenizer(tokenizer)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.format = check_format(format)
        self.mask_prompt, self.shuffle_size, self.seed = mask_prompt, shuffle_buffer, seed
        self.num_epochs, self.drop_last, self.read_chunk = num_epochs, drop_last, read_chunk
        self.weights = None if weights is None else [float(w) for w in weights]
        self._stream = (
            FileStream(self.files, self.tokenizer, self.format, mask_prompt, num_epochs, read_chunk)
            if weights is None
            else MixtureStream(self.files, weights, seed, self.tokenizer, self.format, mask_prompt, read_chunk)
        )
        self._pack_ids: list[int] = []
        self._pack_targets: list[bool] = []
        self._pack_starts: list[bool] = []  # True at the first token of each sample
        self.document_masking = document_masking
        self._shuffle: list[Sample] = []
        self._rng = random.Random(seed)
        self._exhausted = False
        self._settings = dict(format=format, mask_prompt=mask_prompt, shuffle_buffer=shuffle_buffer,
                              seed=seed, num_epochs=num_epochs, drop_last=drop_last,
                              read_chunk=read_chunk, weights=weights,
                              document_masking=document_masking)

    # A loader travels (to a worker process, see tpu_train.data.worker) as its settings and its
    # state: open readers do not pickle, and the state is all its future depends on.
    def __getstate__(self) -> dict[str, Any]:
        return {"files": self.files, "tokenizer": self.tokenizer, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "settings": self._settings,
                "state": self.state_dict()}

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self.__init__(pickled["files"], pickled["tokenizer"], pickled["seq_len"],
                      pickled["batch_size"], **pickled["settings"])
        self.load_state_dict(pickled["state"])

    def _next_sample(self) -> Sample | None:
        if self.shuffle_size <= 1:
            return self._stream.take()
        while len(self._shuffle) < self.shuffle_size:
            sample = self._stream.take()
            if sample is None:
                break
            self._shuffle.append(sample)
        if not self._shuffle:
            return None
        index = self._rng.randrange(len(self._shuffle))
        self._shuffle[index], self._shuffle[-1] = self._shuffle[-1], self._shuffle[index]
        return self._shuffle.pop()

    # -- packing ---------------------------------------------------------------------------

    def _next_row(self) -> tuple[list[int], list[bool], list[bool]] | None:
        """``(ids, targets, sample starts)`` of the next row of ``seq_len + 1`` tokens."""
        width = self.seq_len + 1
        while len(self._pack_ids) < width and not self._exhausted:
            sample = self._next_sample()
            if sample is None:
                self._exhausted = True
                break
            self._pack_ids += sample.ids
            self._pack_targets += sample.targets
            self._pack_starts += [True] + [False] * (len(sample.ids) - 1)
        if len(self._pack_ids) >= width:
            row = (self._pack_ids[:width], self._pack_targets[:width], self._pack_starts[:width])
            del self._pack_ids[: self.seq_len]
            del self._pack_targets[: self.seq_len]
            del self._pack_starts[: self.seq_len]
            return row
        if self.drop_last or len(self._pack_ids) < 2:
            self._pack_ids, self._pack_targets, self._pack_starts = [], [], []
            return None
        missing = width - len(self._pack_ids)
        # The padding is one segment of its own: no sample attends to it.
        row = (self._pack_ids + [self.tokenizer.pad_id] * missing,
               self._pack_targets + [False] * missing,
               self._pack_starts + [True] + [False] * (missing - 1))
        self._pack_ids, self._pack_targets, self._pack_starts = [], [], []
        return row

    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows = []
        while len(rows) < self.batch_size:
            row = self._next_row()
            if row is None:
                break
            rows.append(row)
        if not rows or (self.drop_last and len(rows) < self.batch_size):
            raise StopIteration
        starts = [row[2] for row in rows] if self.document_masking else None
        return rows_to_batch([row[:2] for row in rows], starts)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly after the last batch returned."""
        return {
            "version": STATE_VERSION,
            "files": [p.name for p in self.paths],
            "seq_len": self.seq_len,
            "shuffle_size": self.shuffle_size,
            "weights": self.weights,
            **self._stream.state(),
            "pack_ids": list(self._pack_ids),
            "pack_targets": list(self._pack_targets),
            "pack_starts": list(self._pack_starts),
            "shuffle_buffer": [(s.ids, s.targets) for s in self._shuffle],
            "rng": rng_state(self._rng),
            "exhausted": self._exhausted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` of a loader over the same files and ``seq_len``."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported loader state version {state.get('version')!r} (expected {STATE_VERSION})")
        files = [p.name for p in self.paths]
        # States written before mixtures existed have no "weights": they read files in order.
        saved = (state["files"], state["seq_len"], state["shuffle_size"], state.get("weights"))
        if saved != (files, self.seq_len, self.shuffle_size, self.weights):
            raise ValueError(
                f"loader state is for files {saved[0]} with seq_len={saved[1]}, shuffle_buffer={saved[2]}, "
                f"weights={saved[3]}, but this loader reads {files} with seq_len={self.seq_len}, "
                f"shuffle_buffer={self.shuffle_size}, weights={self.weights}; build the loader with the same "
                "data, seq_len, shuffle_buffer and weights"
            )
        self._stream.load(state)
        self._pack_ids, self._pack_targets = list(state["pack_ids"]), list(state["pack_targets"])
        # States written before sample starts were kept: every sample begins with <bos>.
        bos = self.tokenizer.bos_id
        self._pack_starts = list(state.get("pack_starts", [i == bos for i in self._pack_ids]))
        self._shuffle = [Sample(tuple(ids), tuple(t)) for ids, t in state["shuffle_buffer"]]
        self._rng = rng_from_state(state["rng"])
        self._exhausted = state["exhausted"]
