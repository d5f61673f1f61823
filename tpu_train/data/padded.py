"""Non-packed, padded batches of instruction/chat samples for evaluation and generation.

Each sample stays whole and keeps its prompt and reference text, so a caller can both score the
loss on the response and generate from the prompt and compare with the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from tpu_train.data.chat import format_chat
from tpu_train.data.datasets import Example, check_format, encode_examples
from tpu_train.data.errors import DataError
from tpu_train.data.packing import IGNORE_INDEX, resolve_tokenizer
from tpu_train.data.sources import DataFiles, check_sources
from tpu_train.data.tokenizer import Tokenizer


class PaddedInstructionLoader:
    """Iterates a file of instruction or chat records as padded batches.

    Each batch is a dict:

    * ``tokens`` ``[B, L]``: ``<bos> prompt response <eos>``, right-padded with ``pad_id``;
    * ``labels`` ``[B, L]``: next-token targets, ``-100`` on the prompt (if ``mask_prompt``)
      and on padding;
    * ``prompt_tokens`` ``[B, P]``: ``<bos> prompt``, *left*-padded so every prompt ends at the
      last column (ready for batched generation); ``prompt_lengths`` ``[B]`` gives the real lengths;
    * ``prompts`` / ``references``: the prompt text and the reference response (lists of str).

    For chat records the prompt is the conversation up to the last assistant turn (with the
    assistant header appended) and the reference is that turn's content. Every iteration reads
    the files again from the start. ``max_length`` (optional) truncates ``tokens``/``labels``.
    ``path`` may be several files (read in order) or a ``DataFiles``; ``column_map`` renames
    columns as for :class:`~tpu_train.data.packing.PackedLoader`.
    """

    def __init__(
        self,
        path: str | Path | Sequence[str | Path] | DataFiles,
        tokenizer: Tokenizer | str | Path | None,
        batch_size: int,
        *,
        format: str = "auto",
        mask_prompt: bool = True,
        max_length: int | None = None,
        column_map: Mapping[str, str] | None = None,
    ):
        self.files = DataFiles.of(path, column_map)
        check_sources(self.files)
        self.tokenizer = resolve_tokenizer(tokenizer)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.format = batch_size, check_format(format)
        if self.format == "text":
            raise ValueError("PaddedInstructionLoader needs instruction or chat records, not format='text'")
        self.mask_prompt, self.max_length = mask_prompt, max_length

    def _prompt_ids(self, example: Example) -> list[int]:
        if example.kind == "instruction":
            return [self.tokenizer.bos_id] + self.tokenizer.encode(example.prompt)
        history = [{"role": r, "content": c} for r, c in example.messages[: self._last_assistant(example)]]
        return format_chat(self.tokenizer, history, add_generation_prompt=True).ids

    @staticmethod
    def _last_assistant(example: Example) -> int:
        return max(i for i, (role, _) in enumerate(example.messages) if role == "assistant")

    def _reference(self, example: Example) -> tuple[str, str]:
        if example.kind == "instruction":
            return example.prompt, example.response
        last = self._last_assistant(example)
        prompt = "\n".join(f"{r}: {c.strip()}" for r, c in example.messages[:last])
        return prompt, example.messages[last][1].strip()

    def _batch(self, located: list) -> dict[str, Any]:
        examples = [loc.example for _, loc in located]
        for path, loc in located:
            if loc.example.kind == "text":
                raise DataError(
                    "a text record has no prompt/response to evaluate; padded mode needs instruction or chat records",
                    path,
                    loc.line,
                )
        # A chat ends at its last assistant turn, and only that turn is scored: the rest is prompt.
        examples = [
            Example("chat", messages=e.messages[: self._last_assistant(e) + 1]) if e.kind == "chat" else e
            for e in examples
        ]
        samples = encode_examples(self.tokenizer, examples, self.mask_prompt)
        prompts = [self._prompt_ids(e) for e in examples]
        pad = self.tokenizer.pad_id
        full = [list(s.ids) for s in samples]
        targets = [list(s.targets) for s in samples]
        for prompt, sample_targets in zip(prompts, targets):
            if self.mask_prompt:  # the prompt ids are a prefix of the sample ids
                sample_targets[: len(prompt)] = [False] * len(prompt)
        if self.max_length is not None:
            full = [ids[: self.max_length + 1] for ids in full]
            targets = [t[: self.max_length + 1] for t in targets]
        width = max(map(len, full))
        ids = torch.tensor([row + [pad] * (width - len(row)) for row in full], dtype=torch.long)
        is_target = torch.tensor([row + [False] * (width - len(row)) for row in targets], dtype=torch.bool)
        labels = torch.where(is_target[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE_INDEX))
        prompt_width = max(map(len, prompts))
        prompt_tokens = torch.tensor([[pad] * (prompt_width - len(p)) + p for p in prompts], dtype=torch.long)
        texts = [self._reference(e) for e in examples]
        return {
            "tokens": ids[:, :-1].contiguous(),
            "labels": labels,
            "prompt_tokens": prompt_tokens,
            "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.long),
            "prompts": [p for p, _ in texts],
            "references": [r for _, r in texts],
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        pending: list = []
        for index, path in enumerate(self.files.paths):
            for chunk in self.files.read(index, self.format, chunk_lines=self.batch_size):
                pending += [(path, loc) for loc in chunk]
                while len(pending) >= self.batch_size:
                    yield self._batch(pending[: self.batch_size])
                    pending = pending[self.batch_size :]
        if pending:
            yield self._batch(pending)
