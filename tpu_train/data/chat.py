"""The Llama 3 chat format, with a per-token target mask.

A conversation is rendered as::

    <|begin_of_text|>
    <|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>   (per message)
    <|start_header_id|>assistant<|end_header_id|>\\n\\n                     (generation prompt)

Each piece is encoded separately (header text, the blank line, the stripped content), matching
the reference Llama 3 implementation, so token boundaries never straddle a role header and the
content. Only assistant content and its ``<|eot_id|>`` are training targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from tpu_train.data.errors import DataError
from tpu_train.data.tokenizer import BEGIN_OF_TEXT, END_HEADER, END_OF_TURN, START_HEADER, Tokenizer

CHAT_ROLES = ("system", "user", "assistant", "ipython", "tool")
TARGET_ROLE = "assistant"


@dataclass(frozen=True)
class FormattedChat:
    """Token ids of a conversation and, per token, whether it is a training target."""

    ids: list[int]
    target_mask: list[bool]


def format_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = False,
) -> FormattedChat:
    """Encode ``messages`` (``[{"role": ..., "content": ...}, ...]``) in the Llama 3 chat format.

    ``add_generation_prompt`` appends an empty assistant header so a model continues with the
    assistant's reply. Raises ``DataError`` for a malformed message or when the tokenizer lacks
    the Llama 3 special tokens.
    """
    if not messages:
        raise DataError("a chat needs at least one message")
    begin, start, end, eot = (tokenizer.token_id(t) for t in (BEGIN_OF_TEXT, START_HEADER, END_HEADER, END_OF_TURN))
    roles, contents = [], []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise DataError(f"message {index} must be an object with 'role' and 'content' fields, got {message!r}")
        role, content = message["role"], message["content"]
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise DataError(
                f"message {index}: role must be one of {', '.join(CHAT_ROLES)} and content a string, "
                f"got role={role!r}, content of type {type(content).__name__}"
            )
        roles.append(role)
        contents.append(content.strip())
    if add_generation_prompt:
        roles.append(TARGET_ROLE)
    # One batched call for every text piece: roles, the blank line, and contents.
    pieces = tokenizer.encode_batch(roles + ["\n\n"] + contents)
    role_ids, blank_line, content_ids = pieces[: len(roles)], pieces[len(roles)], pieces[len(roles) + 1 :]

    ids, mask = [begin], [False]
    for index, role in enumerate(roles):
        header = [start] + role_ids[index] + [end] + blank_line
        ids += header
        mask += [False] * len(header)
        if index == len(contents):  # the generation prompt: header only
            break
        body = content_ids[index] + [eot]
        ids += body
        mask += [role == TARGET_ROLE] * len(body)
    return FormattedChat(ids, mask)
