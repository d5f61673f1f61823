"""The Llama 3 chat format, with a per-token target mask.

A conversation is rendered as::

    <|begin_of_text|>
    <|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>   (per message)
    <|start_header_id|>assistant<|end_header_id|>\\n\\n                     (generation prompt)

Each piece is encoded separately (header text, the blank line, the stripped content), matching
the reference Llama 3 implementation, so token boundaries never straddle a role header and the
content. Only assistant content and its ``<|eot_id|>`` are training targets.

A tokenizer with its own ``chat_template`` (Hugging Face Jinja, from ``chat_template.jinja`` or
``tokenizer_config.json``) is rendered with it instead, as ``transformers``'
``apply_chat_template`` does (the whole text tokenized at once, special-token text parsed); the
targets are the characters each assistant message adds to the rendering of the conversation
before it with a generation prompt (its content and end-of-turn markup).
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
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "encode_with_offsets"):
        _check_messages(messages)
        return _format_with_template(tokenizer, messages, add_generation_prompt)
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


def _check_messages(messages: Sequence[Mapping[str, str]]) -> None:
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise DataError(f"message {index} must be an object with 'role' and 'content' fields, got {message!r}")
        if message["role"] not in CHAT_ROLES or not isinstance(message["content"], str):
            raise DataError(
                f"message {index}: role must be one of {', '.join(CHAT_ROLES)} and content a string, "
                f"got role={message['role']!r}, content of type {type(message['content']).__name__}"
            )


_TEMPLATES: dict[str, object] = {}


def _compile(template: str):
    """A Jinja template compiled as transformers compiles chat templates (sandboxed,
    trim_blocks, lstrip_blocks, loop controls, ``tojson``, ``raise_exception``,
    ``strftime_now``; ``{% generation %}`` blocks render their body)."""
    if template in _TEMPLATES:
        return _TEMPLATES[template]
    import datetime
    import json

    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise DataError(f"the tokenizer's chat_template refused the conversation: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateError as exc:
        raise DataError(f"the tokenizer's chat_template is not valid Jinja: {exc}") from None
    _TEMPLATES[template] = compiled
    return compiled


def _render(tokenizer: Tokenizer, messages, add_generation_prompt: bool) -> str:
    import jinja2

    specials = {f"{role}_token": tokenizer.decode([getattr(tokenizer, f"{role}_id")])
                for role in ("bos", "eos", "pad")}
    try:
        return _compile(tokenizer.chat_template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            **specials)
    except jinja2.TemplateError as exc:
        raise DataError(f"the tokenizer's chat_template failed: {exc}") from None


def _format_with_template(tokenizer: Tokenizer, messages, add_generation_prompt: bool) -> FormattedChat:
    text = _render(tokenizer, messages, add_generation_prompt)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != TARGET_ROLE:
            continue
        before = _render(tokenizer, messages[:index], True) if index else ""
        through = _render(tokenizer, messages[: index + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(
                "the tokenizer's chat_template does not render a conversation as the rendering of "
                "its first turns followed by the next one, so the assistant turns cannot be "
                "told apart for the loss mask"
            )
        spans.append((len(before), len(through)))
    ids, offsets = tokenizer.encode_with_offsets(text)
    mask = [any(lo <= start < hi for lo, hi in spans) for start, _ in offsets]
    return FormattedChat(ids, mask)
