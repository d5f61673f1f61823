"""Tokenizers behind one small interface.

Two file formats are supported:

* Hugging Face ``tokenizer.json`` (read with the ``tokenizers`` library), e.g. Llama 3 and the
  bundled 512-token default;
* SentencePiece ``tokenizer.model`` (read with ``sentencepiece``), e.g. Llama 2.

``load_tokenizer(path)`` accepts either file or a directory holding one of them. The special
tokens (bos/eos/pad) come from the files Hugging Face keeps next to it when they exist
(``tokenizer_config.json``, then ``special_tokens_map.json``, then ``generation_config.json``),
else from the usual token names. ``Tokenizer.save_pretrained(directory)`` writes the files
``transformers.AutoTokenizer`` reads.
"""

from __future__ import annotations

import abc
import json
import shutil
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from tpu_train.data.errors import DataError

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
END_OF_TURN = "<|eot_id|>"
PAD = "<|pad|>"

#: Special tokens of the bundled tokenizer, in id order (ids 0..5).
DEFAULT_SPECIAL_TOKENS = (BEGIN_OF_TEXT, END_OF_TEXT, START_HEADER, END_HEADER, END_OF_TURN, PAD)

HF_TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_ROLES = ("bos", "eos", "pad")


def read_chat_template(directory: str | Path) -> str | None:
    """The Jinja chat template kept beside a tokenizer: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates of
    which ``default`` is taken); None when there is none."""
    directory = Path(directory)
    path = directory / CHAT_TEMPLATE_FILE
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"cannot read the chat template ({exc})", path) from None
    config = directory / TOKENIZER_CONFIG_FILE
    if not config.is_file():
        return None
    template = _read_json_object(config).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _read_json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"not readable JSON ({exc})", path) from None
    if not isinstance(data, dict):
        raise DataError(f"expected a JSON object, got {type(data).__name__}", path)
    return data


def _token_text(value) -> str | None:
    """``"<s>"`` or transformers' serialized AddedToken ``{"content": "<s>", ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def read_special_tokens(directory: str | Path) -> dict[str, tuple[str | int, Path]]:
    """``{"bos"|"eos"|"pad": (token text or id, file it came from)}`` for the roles that
    ``tokenizer_config.json``, ``special_tokens_map.json`` or ``generation_config.json`` (in this
    order of precedence) in ``directory`` name. A list of eos ids gives its first."""
    directory = Path(directory)
    found: dict[str, tuple[str | int, Path]] = {}
    for name in (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE):
        path = directory / name
        if path.is_file():
            data = _read_json_object(path)
            for role in SPECIAL_ROLES:
                text = _token_text(data.get(f"{role}_token"))
                if text is not None and role not in found:
                    found[role] = (text, path)
    path = directory / GENERATION_CONFIG_FILE
    if path.is_file():
        data = _read_json_object(path)
        for role in SPECIAL_ROLES:
            value = data.get(f"{role}_token_id")
            if isinstance(value, list):
                value = value[0] if value else None
            if isinstance(value, int) and not isinstance(value, bool) and role not in found:
                found[role] = (value, path)
    return found


def default_tokenizer_path() -> Path:
    """Path of the bundled byte-level BPE ``tokenizer.json`` (512 tokens)."""
    return Path(__file__).resolve().parent.parent / "assets" / "tokenizer" / HF_TOKENIZER_FILE


class Tokenizer(abc.ABC):
    """Text <-> token ids, plus the ids of the special tokens the pipeline relies on.

    ``bos_id`` and ``eos_id`` are always set; ``pad_id`` falls back to ``eos_id`` when the
    vocabulary has no pad token (padding positions are always masked out of the loss, so the
    value only has to be a valid id).
    """

    path: Path
    #: Jinja chat template (Hugging Face ``chat_template``) or None: the Llama 3 format is used.
    chat_template: str | None = None

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the model's embedding must cover."""

    @property
    @abc.abstractmethod
    def special_ids(self) -> dict[str, int]:
        """Special/control token text -> id."""

    @abc.abstractmethod
    def _encode_plain(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text, without BOS/EOS.

        Hugging Face tokenizers treat special-token text as plain text here; SentencePiece
        always matches its user-defined pieces, which the library does not let us disable.
        """

    @abc.abstractmethod
    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; special tokens are rendered as their text unless ``skip_special``."""

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @abc.abstractmethod
    def _piece_id(self, token: str) -> int | None:
        """Id of the vocabulary entry ``token`` (any token, special or not), or None."""

    @abc.abstractmethod
    def _piece(self, token_id: int) -> str:
        """Text of the vocabulary entry ``token_id``."""

    def _resolve_specials(self, special_tokens: Mapping[str, tuple[str | int, Path]] | None) -> dict:
        """``{role: id}`` for the roles named in ``special_tokens``; a clear error for a token
        the vocabulary lacks."""
        ids = {}
        for role, (value, source) in (special_tokens or {}).items():
            if isinstance(value, str):
                token_id = self._piece_id(value)
                if token_id is None:
                    raise DataError(f"{source.name} names {role} token {value!r}, which is not in "
                                    f"the tokenizer's vocabulary", self.path)
            else:
                token_id = value
                if not 0 <= token_id < self.vocab_size:
                    raise DataError(f"{source.name} gives {role}_token_id={value}, outside the "
                                    f"tokenizer's {self.vocab_size} ids", self.path)
            ids[role] = token_id
        return ids

    def save_pretrained(self, directory: str | Path) -> list[Path]:
        """Write the tokenizer file and ``tokenizer_config.json`` / ``special_tokens_map.json``
        (the source's, with this tokenizer's bos/eos/pad filled in) into ``directory``, so that
        ``transformers.AutoTokenizer.from_pretrained(directory)`` loads it. Returns the paths."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / self.path.name
        if target.resolve() != self.path.resolve():
            shutil.copyfile(self.path, target)
        tokens = {f"{role}_token": self._piece(getattr(self, f"{role}_id")) for role in SPECIAL_ROLES}
        written = [target]
        template_file = self.path.parent / CHAT_TEMPLATE_FILE
        if template_file.is_file() and template_file.resolve() != (directory / CHAT_TEMPLATE_FILE).resolve():
            shutil.copyfile(template_file, directory / CHAT_TEMPLATE_FILE)
            written.append(directory / CHAT_TEMPLATE_FILE)
        for name, defaults in ((TOKENIZER_CONFIG_FILE, self._tokenizer_config_defaults()),
                               (SPECIAL_TOKENS_MAP_FILE, {})):
            source = self.path.parent / name
            data = _read_json_object(source) if source.is_file() else dict(defaults)
            for key, text in tokens.items():
                if _token_text(data.get(key)) is None:
                    data[key] = text
            (directory / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n",
                                          encoding="utf-8")
            written.append(directory / name)
        return written

    def _tokenizer_config_defaults(self) -> dict:
        return {}

    def token_id(self, token: str) -> int:
        """Id of a special token; a clear error if this vocabulary lacks it."""
        try:
            return self.special_ids[token]
        except KeyError:
            raise DataError(
                f"tokenizer has no special token {token!r} (it has: "
                f"{', '.join(sorted(self.special_ids)) or 'none'}); use a tokenizer with the "
                "Llama 3 special tokens, e.g. the bundled default",
                self.path,
            ) from None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``text``; optionally framed by BOS/EOS.

        Special-token text inside ``text`` (e.g. a literal ``"<|eot_id|>"`` typed by a user) is
        encoded as ordinary text, so data cannot inject control tokens.
        """
        return self.encode_batch([text], bos=bos, eos=eos)[0]

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        """``encode`` for many texts at once (parallel for Hugging Face tokenizers)."""
        out = self._encode_plain(list(texts))
        if bos or eos:
            head = [self.bos_id] if bos else []
            tail = [self.eos_id] if eos else []
            out = [head + ids + tail for ids in out]
        return out


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` read with the ``tokenizers`` library."""

    def __init__(self, path: str | Path,
                 special_tokens: Mapping[str, tuple[str | int, Path]] | None = None):
        from tokenizers import Tokenizer as _RustTokenizer

        self.path = Path(path)
        try:
            self._tok = _RustTokenizer.from_file(str(self.path))
        except Exception as exc:  # the library raises a bare Exception on bad JSON
            raise DataError(f"cannot read tokenizer file: {exc}", self.path) from exc
        self._tok.encode_special_tokens = True
        self._special = {
            added.content: idx
            for idx, added in self._tok.get_added_tokens_decoder().items()
            if added.special
        }
        given = self._resolve_specials(special_tokens)
        self._bos_id = given["bos"] if "bos" in given else self._pick(
            BEGIN_OF_TEXT, "<s>", "[BOS]", "<bos>")
        self._eos_id = given["eos"] if "eos" in given else self._pick(
            END_OF_TEXT, "</s>", "[EOS]", "<eos>", "<|endoftext|>")
        pad = given.get("pad", self._find(PAD, "<pad>", "[PAD]", "<|finetune_right_pad_id|>"))
        self._pad_id = self._eos_id if pad is None else pad

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` in which special-token text IS parsed as the special token (as
        transformers tokenizes a rendered chat template), with each token's character span."""
        if getattr(self, "_tok_parsing_specials", None) is None:
            from tokenizers import Tokenizer as _RustTokenizer

            self._tok_parsing_specials = _RustTokenizer.from_str(self._tok.to_str())
            self._tok_parsing_specials.encode_special_tokens = False
        encoding = self._tok_parsing_specials.encode(text, add_special_tokens=False)
        return list(encoding.ids), list(encoding.offsets)

    def _piece_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _piece(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    def _tokenizer_config_defaults(self) -> dict:
        return {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}

    def _find(self, *names: str) -> int | None:
        for name in names:
            if name in self._special:
                return self._special[name]
        return None

    def _pick(self, *names: str) -> int:
        found = self._find(*names)
        if found is None:
            raise DataError(
                f"tokenizer has none of the special tokens {', '.join(names)}; a BOS and an EOS "
                "token are required",
                self.path,
            )
        return found

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> dict[str, int]:
        return dict(self._special)

    def _encode_plain(self, texts: Sequence[str]) -> list[list[int]]:
        if len(texts) == 1:
            return [self._tok.encode(texts[0], add_special_tokens=False).ids]
        # encode_batch_fast (tokenizers >= 0.20) skips offset tracking we never use.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [enc.ids for enc in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``tokenizer.model`` read with the ``sentencepiece`` library."""

    def __init__(self, path: str | Path,
                 special_tokens: Mapping[str, tuple[str | int, Path]] | None = None):
        import sentencepiece

        self.path = Path(path)
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(str(self.path))
        except Exception as exc:
            raise DataError(f"cannot read SentencePiece model: {exc}", self.path) from exc
        given = self._resolve_specials(special_tokens)
        bos = given.get("bos", self._sp.bos_id())
        eos = given.get("eos", self._sp.eos_id())
        if bos < 0 or eos < 0:
            raise DataError("SentencePiece model defines no BOS or EOS piece; both are required", self.path)
        self._bos_id, self._eos_id = bos, eos
        pad = given.get("pad", self._sp.pad_id())
        self._pad_id = pad if pad >= 0 else self._eos_id
        # Control pieces (<s>, </s>, ...) plus markup-like user-defined pieces such as
        # "<|eot_id|>"; sentencepiece exposes no direct "user defined" query.
        self._special = {}
        for i in range(self._sp.GetPieceSize()):
            piece = self._sp.IdToPiece(i)
            markup = piece.startswith("<") and piece.endswith(">") and len(piece) > 2
            if self._sp.IsControl(i) or (markup and not self._sp.IsByte(i) and not self._sp.IsUnknown(i)):
                self._special[piece] = i

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    def _piece_id(self, token: str) -> int | None:
        token_id = self._sp.PieceToId(token)
        return None if token_id == self._sp.unk_id() and token != self._sp.IdToPiece(token_id) else token_id

    def _piece(self, token_id: int) -> str:
        return self._sp.IdToPiece(token_id)

    def _tokenizer_config_defaults(self) -> dict:
        return {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False}

    @property
    def special_ids(self) -> dict[str, int]:
        return dict(self._special)

    def _encode_plain(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self._sp.Encode(list(texts), out_type=int)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        ids = list(ids)
        if not skip_special:
            # sentencepiece drops control pieces when decoding; render them as their text.
            parts, run = [], []
            for i in ids:
                if self._sp.IsControl(i):
                    if run:
                        parts.append(self._sp.Decode(run))
                        run = []
                    parts.append(self._sp.IdToPiece(i))
                else:
                    run.append(i)
            if run:
                parts.append(self._sp.Decode(run))
            return "".join(parts)
        specials = set(self._special.values())
        return self._sp.Decode([i for i in ids if i not in specials])


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load a tokenizer from ``tokenizer.json``/``tokenizer.model`` or a directory holding one.

    ``None`` loads the bundled default. The file type is chosen by name (``.json`` -> Hugging
    Face, ``.model`` -> SentencePiece); a directory is searched for ``tokenizer.json`` first.
    Special tokens named by the Hugging Face files beside it are used (:func:`read_special_tokens`).
    """
    if path is None:
        path = default_tokenizer_path()
    path = Path(path)
    if path.is_dir():
        for name, cls in ((HF_TOKENIZER_FILE, HFTokenizer), (SENTENCEPIECE_FILE, SentencePieceTokenizer)):
            if (path / name).is_file():
                tokenizer = cls(path / name, read_special_tokens(path))
                tokenizer.chat_template = read_chat_template(path)
                return tokenizer
        raise DataError(
            f"no tokenizer found in this directory: expected {HF_TOKENIZER_FILE} (Hugging Face) or "
            f"{SENTENCEPIECE_FILE} (SentencePiece)",
            path,
        )
    if not path.exists():
        raise DataError(
            f"tokenizer not found; pass a {HF_TOKENIZER_FILE} / {SENTENCEPIECE_FILE} file or a "
            "directory holding one",
            path,
        )
    if path.suffix == ".json":
        tokenizer = HFTokenizer(path, read_special_tokens(path.parent))
        tokenizer.chat_template = read_chat_template(path.parent)
        return tokenizer
    if path.suffix == ".model":
        return SentencePieceTokenizer(path, read_special_tokens(path.parent))
    raise DataError(
        f"unrecognised tokenizer file type {path.suffix!r}: expected a .json (Hugging Face) or "
        ".model (SentencePiece) file",
        path,
    )
