"""Reading records from data files and turning them into token ids with a target mask.

Accepted files (the format is decided per record, or forced with ``format=``):

* plain text (``.txt``): one sample per non-blank line;
* JSONL (any other name), one JSON object per line, with one of these field sets:

  =============  ===========================================  ==========================
  format         fields                                       prompt (masked) / target
  =============  ===========================================  ==========================
  text           ``text``                                     - / everything
  instruction    ``prompt``, ``response``                     prompt / response
  instruction    ``instruction``, ``input`` (optional),        templated instruction /
                 ``output`` (alpaca style)                    output
  chat           ``messages``: ``[{"role", "content"}, ...]``  all but assistant turns /
                                                              assistant turns
  =============  ===========================================  ==========================

A prompt/response record is joined by a template (``template=``, ``data.template`` in recipes):

* ``default``: :data:`DEFAULT_TEMPLATE` (``### Instruction:`` / ``### Response:`` headers, the
  layout of alpaca records), so the model sees where the prompt ends and the answer starts;
* ``chat``: the record becomes a chat of one user and one assistant message, rendered by the
  tokenizer's chat template (or the Llama 3 chat format; :mod:`tpu_train.data.chat`);
* ``none``: ``prompt`` and ``response`` joined as they are (put your own separator in them);
* ``auto`` (resolved by the caller that knows the tokenizer, :func:`resolve_template`):
  ``chat`` when the tokenizer has a chat template, else ``default``.

Each sample becomes ``<bos> ... <eos>``. The target mask marks the tokens a model is trained to
predict; with ``mask_prompt=False`` everything after ``<bos>`` is a target.

Files are read line by line from a byte offset, never whole, so readers are cheap to resume.
``column_map`` renames a record's fields first. JSON, Parquet and saved datasets are read into
the same records by :mod:`tpu_train.data.sources`, which also decides the kind by extension.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from tpu_train.data.chat import CHAT_ROLES, format_chat
from tpu_train.data.errors import DataError
from tpu_train.data.tokenizer import Tokenizer

FORMATS = ("auto", "text", "instruction", "chat")
TEXT_SUFFIXES = (".txt", ".text")

ALPACA_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_INPUT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
# data.template=default for {"prompt", "response"} records: alpaca's layout, one separator between
# the prompt and the response.
DEFAULT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"
TEMPLATES = ("auto", "chat", "default", "none")

ACCEPTED_FIELDS = (
    "'text' (text), 'prompt' + 'response' (instruction), 'instruction' + optional 'input' + "
    "'output' (alpaca instruction), or 'messages' (chat)"
)


@dataclass(frozen=True)
class Example:
    """One parsed record. ``kind`` is ``"text"``, ``"instruction"`` or ``"chat"``."""

    kind: str
    text: str = ""
    prompt: str = ""
    response: str = ""
    messages: tuple = ()


@dataclass(frozen=True)
class Sample:
    """Token ids of one example and, per id, whether it is a training target."""

    ids: tuple[int, ...]
    targets: tuple[bool, ...]


@dataclass(frozen=True)
class Located:
    """A parsed example and where the reader stands after it (to resume just past it)."""

    example: Example
    line: int  # 1-based line number of this record
    end_offset: int  # byte offset of the next line


def check_template(template: str) -> str:
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt/response template {template!r}; choose from {', '.join(TEMPLATES)}")
    return template


def resolve_template(template: str, tokenizer: Tokenizer) -> str:
    """``template`` with ``auto`` made ``chat`` (the tokenizer has a chat template) or
    ``default``."""
    if check_template(template) != "auto":
        return template
    return "chat" if getattr(tokenizer, "chat_template", None) else "default"


def _instruction(prompt: str, response: str, template: str, alpaca: bool = False) -> Example:
    """A prompt/response record under ``template`` (``auto`` resolved): a chat of two messages
    for ``chat``; else an instruction whose prompt carries the template's markup. An alpaca
    record's prompt already has its own (the default's) layout."""
    if template == "chat":
        return Example("chat", messages=(("user", prompt), ("assistant", response)))
    if template == "default" and not alpaca:
        prompt = DEFAULT_TEMPLATE.format(prompt=prompt)
    return Example("instruction", prompt=prompt, response=response)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r}; choose from {', '.join(FORMATS)}")
    return fmt


def check_data_file(path: str | Path) -> Path:
    """The path, or a ``DataError`` if it is missing or not a regular file."""
    path = Path(path)
    if not path.exists():
        raise DataError("data file not found; check the path (data.path in recipes)", path)
    if not path.is_file():
        raise DataError("data path is not a regular file; pass a data file (.jsonl, .txt, .json, .parquet)", path)
    return path


def _string_field(record: dict, name: str, path: Path, line: int, required: bool = True) -> str:
    if name not in record:
        if not required:
            return ""
        raise DataError(
            f"missing field {name!r} (record has {', '.join(map(repr, record)) or 'no fields'}); "
            f"accepted fields: {ACCEPTED_FIELDS}",
            path,
            line,
        )
    value = record[name]
    if not isinstance(value, str):
        raise DataError(f"field {name!r} must be a string, got {type(value).__name__}", path, line)
    return value


def _chat_messages(record: dict, path: Path, line: int) -> tuple:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError("field 'messages' must be a non-empty list of {role, content} objects", path, line)
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
            message.get("content"), str
        ):
            raise DataError(
                f"messages[{index}] must be an object with string fields 'role' and 'content', got {message!r}",
                path,
                line,
            )
        if message["role"] not in CHAT_ROLES:
            raise DataError(
                f"messages[{index}] has role {message['role']!r}; accepted roles: {', '.join(CHAT_ROLES)}",
                path,
                line,
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("a chat record needs at least one message with role 'assistant'", path, line)
    return tuple((m["role"], m["content"]) for m in messages)


def apply_column_map(record: dict, column_map: Mapping[str, str], path: Path, line: int) -> dict:
    """``record`` with each mapped column renamed to our field name (``column_map``: ours ->
    the file's). A record that already has our field keeps it, so one map serves a mixture of
    files of which only some need renaming; a record with neither is an error naming both."""
    if not column_map:
        return record
    renamed = dict(record)
    for ours, theirs in column_map.items():
        if theirs in record:
            renamed[ours] = renamed.pop(theirs)
        elif ours not in record:
            raise DataError(
                f"column {theirs!r} (data.column_map.{ours}={theirs}) not found; the record has "
                f"{', '.join(map(repr, record)) or 'no fields'}",
                path,
                line,
            )
    return renamed


def parse_fields(
    record: Any,
    path: Path,
    line: int,
    fmt: str = "auto",
    column_map: Mapping[str, str] | None = None,
    template: str = "none",
) -> Example:
    """One record (a dict of fields) as an :class:`Example` (``DataError`` names file:line);
    a prompt/response record joined by ``template`` (not ``auto``: see the module docstring)."""
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object per line, got a {type(record).__name__}", path, line)
    record = apply_column_map(record, column_map or {}, path, line)
    if fmt == "auto":
        if "messages" in record:
            fmt = "chat"
        elif "prompt" in record or "instruction" in record:
            fmt = "instruction"
        elif "text" in record:
            fmt = "text"
        else:
            raise DataError(
                f"no recognised fields (record has {', '.join(map(repr, record)) or 'no fields'}); "
                f"accepted fields: {ACCEPTED_FIELDS}",
                path,
                line,
            )
    if fmt == "text":
        return Example("text", text=_string_field(record, "text", path, line))
    if fmt == "chat":
        if "messages" not in record:
            _string_field(record, "messages", path, line)  # raises the missing-field error
        return Example("chat", messages=_chat_messages(record, path, line))
    if "instruction" in record and "prompt" not in record:
        instruction = _string_field(record, "instruction", path, line)
        extra = _string_field(record, "input", path, line, required=False)
        output = _string_field(record, "output", path, line)
        if template == "chat":
            return _instruction(f"{instruction}\n\n{extra}" if extra.strip() else instruction, output, template)
        alpaca = ALPACA_INPUT_TEMPLATE if extra.strip() else ALPACA_TEMPLATE
        return _instruction(alpaca.format(instruction=instruction, input=extra), output, template, alpaca=True)
    return _instruction(
        _string_field(record, "prompt", path, line), _string_field(record, "response", path, line), template
    )


def parse_record(
    raw: bytes,
    path: Path,
    line: int,
    fmt: str = "auto",
    column_map: Mapping[str, str] | None = None,
    template: str = "none",
) -> Example:
    """Parse one line of a data file into an :class:`Example` (``DataError`` names file:line)."""
    if path.suffix in TEXT_SUFFIXES:
        if fmt not in ("auto", "text"):
            raise DataError(f"a plain-text file only holds 'text' samples, but format={fmt!r} was asked", path)
        return Example("text", text=raw.decode("utf-8", errors="replace").rstrip("\r\n"))
    try:
        record: Any = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        detail = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise DataError(f"malformed JSON ({detail}); each line must be one JSON object", path, line) from None
    return parse_fields(record, path, line, fmt, column_map, template)


def read_records(
    path: str | Path,
    fmt: str = "auto",
    offset: int = 0,
    line: int = 0,
    chunk_lines: int = 256,
    column_map: Mapping[str, str] | None = None,
    template: str = "none",
) -> Iterator[list[Located]]:
    """Parsed records of ``path`` from byte ``offset`` (``line`` lines already read), in chunks.

    Blank lines are skipped. A file with no record at all raises ``DataError``.
    """
    path = check_data_file(path)
    check_format(fmt)
    found_any = offset > 0
    with path.open("rb") as f:
        f.seek(offset)
        chunk: list[Located] = []
        for raw in f:
            offset += len(raw)
            line += 1
            if not raw.strip():
                continue
            found_any = True
            chunk.append(Located(parse_record(raw, path, line, fmt, column_map, template), line, offset))
            if len(chunk) >= chunk_lines:
                yield chunk
                chunk = []
        if chunk:
            yield chunk
    if not found_any:
        raise DataError("data file is empty (no non-blank line); add at least one record", path)


def encode_examples(tokenizer: Tokenizer, examples: Sequence[Example], mask_prompt: bool = True) -> list[Sample]:
    """Token ids and target masks of ``examples``, one tokenizer call for all plain texts."""
    texts: list[str] = []
    for example in examples:
        if example.kind == "text":
            texts.append(example.text)
        elif example.kind == "instruction":
            texts += [example.prompt, example.response]
    encoded = iter(tokenizer.encode_batch(texts)) if texts else iter(())
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    samples = []
    for example in examples:
        if example.kind == "text":
            body = next(encoded)
            ids, targets = [bos] + body + [eos], [False] + [True] * (len(body) + 1)
        elif example.kind == "instruction":
            prompt, response = next(encoded), next(encoded)
            ids = [bos] + prompt + response + [eos]
            targets = [False] + [not mask_prompt] * len(prompt) + [True] * (len(response) + 1)
        else:
            chat = format_chat(tokenizer, [{"role": r, "content": c} for r, c in example.messages])
            ids = chat.ids + [eos]
            # The closing <eos> only separates packed samples; the turn already ended with <eot>.
            targets = list(chat.target_mask) + [False] if mask_prompt else [False] + [True] * len(chat.ids)
        samples.append(Sample(tuple(ids), tuple(targets)))
    return samples
