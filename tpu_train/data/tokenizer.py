"""Tokenizers behind one small interface.

Two file formats are supported:

* Hugging Face ``tokenizer.json`` (read with the ``tokenizers`` library), e.g. Llama 3 and the
  bundled 512-token default;
* SentencePiece ``tokenizer.model`` (read with ``sentencepiece``), e.g. Llama 2.

``load_tokenizer(path)`` accepts either file or a directory holding one of them.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Iterable, Sequence

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

    def __init__(self, path: str | Path):
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
        self._bos_id = self._pick(BEGIN_OF_TEXT, "<s>", "[BOS]", "<bos>")
        self._eos_id = self._pick(END_OF_TEXT, "</s>", "[EOS]", "<eos>", "<|endoftext|>")
        pad = self._find(PAD, "<pad>", "[PAD]", "<|finetune_right_pad_id|>")
        self._pad_id = self._eos_id if pad is None else pad

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

    def __init__(self, path: str | Path):
        import sentencepiece

        self.path = Path(path)
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(str(self.path))
        except Exception as exc:
            raise DataError(f"cannot read SentencePiece model: {exc}", self.path) from exc
        if self._sp.bos_id() < 0 or self._sp.eos_id() < 0:
            raise DataError("SentencePiece model defines no BOS or EOS piece; both are required", self.path)
        self._bos_id = self._sp.bos_id()
        self._eos_id = self._sp.eos_id()
        self._pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self._eos_id
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
    """
    if path is None:
        path = default_tokenizer_path()
    path = Path(path)
    if path.is_dir():
        for name, cls in ((HF_TOKENIZER_FILE, HFTokenizer), (SENTENCEPIECE_FILE, SentencePieceTokenizer)):
            if (path / name).is_file():
                return cls(path / name)
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
        return HFTokenizer(path)
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    raise DataError(
        f"unrecognised tokenizer file type {path.suffix!r}: expected a .json (Hugging Face) or "
        ".model (SentencePiece) file",
        path,
    )
