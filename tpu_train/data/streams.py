"""Resumable streams of tokenized samples: files in order, or a weighted mixture of files.

A stream hands out one :class:`~tpu_train.data.datasets.Sample` at a time and can say where it
stands just after the last sample handed out (``state()``), so that a new stream given that
state (``load()``) hands out exactly what the old one would have. Read-ahead (a chunk of
records tokenized at once) is never part of the state: it is re-read on resume.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, Iterator, Sequence

from tpu_train.data.datasets import Sample, encode_examples
from tpu_train.data.sources import DataFiles
from tpu_train.data.tokenizer import Tokenizer

# (epoch, file index, offset, line) just after the last sample taken; see read_source.
Position = tuple[int, int, int, int]


def rng_state(rng: random.Random) -> list:
    """``rng``'s state as lists and numbers (it must survive ``torch.save`` and JSON)."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def rng_from_state(state: Sequence) -> random.Random:
    version, internal, gauss = state
    rng = random.Random()
    rng.setstate((version, tuple(internal), gauss))
    return rng


class FileStream:
    """The samples of ``files`` in order, every epoch (``num_epochs=None``: forever)."""

    def __init__(
        self,
        files: DataFiles,
        tokenizer: Tokenizer,
        fmt: str,
        mask_prompt: bool,
        num_epochs: int | None,
        read_chunk: int,
    ):
        self.files, self.tokenizer, self.format, self.mask_prompt = files, tokenizer, fmt, mask_prompt
        self.num_epochs, self.read_chunk = num_epochs, read_chunk
        self.restore((0, 0, 0, 0))

    def restore(self, position: Position) -> None:
        self.position = tuple(position)
        self._read_pos = self.position  # where read-ahead continues (>= position)
        self._ahead: deque[tuple[Sample, Position]] = deque()
        self._reader: Iterator | None = None

    def _read_ahead(self) -> bool:
        """Tokenize the next chunk of records into ``_ahead``; False once all epochs are read."""
        while not self._ahead:
            epoch, file_index, offset, line = self._read_pos
            if self.num_epochs is not None and epoch >= self.num_epochs:
                return False
            if self._reader is None:
                self._reader = self.files.read(file_index, self.format, offset, line, self.read_chunk)
            chunk = next(self._reader, None)
            if chunk is None:
                self._reader = None
                last_file = file_index + 1 == len(self.files.paths)
                self._read_pos = (epoch + 1, 0, 0, 0) if last_file else (epoch, file_index + 1, 0, 0)
                # Nothing is pending, so the taken position moves too: a saved state skips the
                # finished file instead of re-opening it.
                self.position = self._read_pos
                continue
            samples = encode_examples(self.tokenizer, [loc.example for loc in chunk], self.mask_prompt)
            for sample, loc in zip(samples, chunk):
                self._ahead.append((sample, (epoch, file_index, loc.end_offset, loc.line)))
            self._read_pos = self._ahead[-1][1]
        return True

    def take(self) -> Sample | None:
        """The next sample, or None after the last epoch."""
        if not self._ahead and not self._read_ahead():
            return None
        sample, self.position = self._ahead.popleft()
        return sample

    def state(self) -> dict[str, int]:
        epoch, file_index, offset, line = self.position
        return {"epoch": epoch, "file_index": file_index, "offset": offset, "line": line}

    def load(self, state: dict[str, Any]) -> None:
        self.restore((state["epoch"], state["file_index"], state["offset"], state["line"]))


class MixtureStream:
    """Each sample from file ``i`` with probability ``weights[i] / sum(weights)``, forever.

    Every file cycles on its own (a small file repeats more often than a large one). The
    choices come from an RNG seeded by ``seed`` alone, so every process of a run draws the same
    sequence; the state holds each file's position and that RNG.
    """

    def __init__(
        self,
        files: DataFiles,
        weights: Sequence[float],
        seed: int,
        tokenizer: Tokenizer,
        fmt: str,
        mask_prompt: bool,
        read_chunk: int,
    ):
        self.weights = check_weights(weights, len(files.paths))
        self.streams = [
            FileStream(files.only(index), tokenizer, fmt, mask_prompt, None, read_chunk)
            for index in range(len(files.paths))
        ]
        # A string seed is hashed with SHA-512 (not Python's salted hash): the same on every run.
        self._rng = random.Random(f"mixture-{seed}")
        self._choices = range(len(self.streams))

    def take(self) -> Sample | None:
        index = self._rng.choices(self._choices, weights=self.weights)[0]
        return self.streams[index].take()

    def state(self) -> dict[str, Any]:
        return {"streams": [s.state() for s in self.streams], "mixture_rng": rng_state(self._rng)}

    def load(self, state: dict[str, Any]) -> None:
        for stream, position in zip(self.streams, state["streams"]):
            stream.load(position)
        self._rng = rng_from_state(state["mixture_rng"])


def check_weights(weights: Sequence[float], num_files: int) -> list[float]:
    """``weights`` as floats, or ``ValueError`` unless one positive finite weight per file."""
    weights = [float(w) for w in weights]
    if len(weights) != num_files:
        raise ValueError(f"{len(weights)} weights for {num_files} data files; give one weight per file")
    for index, weight in enumerate(weights):
        if not 0 < weight < float("inf"):
            raise ValueError(f"weight {index} is {weight}; weights must be positive and finite")
    return weights
