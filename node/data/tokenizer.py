"""Tokenizers: text to token ids and back.

Owns the byte-level default (``ByteTokenizer``: UTF-8 bytes, lossless, no vocabulary file)
and a Hugging Face ``tokenizer.json`` read by path (``HFTokenizer``, which needs the
``tokenizers`` package of the optional ``data`` extra and is imported only when used).
Does not own corpora or batching (``node.data.dataset``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

DOC_SEPARATOR = "\n\n"
"""Text between two documents when a tokenizer has no end-of-text token."""


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids; lossless, no vocabulary file."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


# Tokens that end a document, in the order they are looked for in a tokenizer.json.
_EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from a ``tokenizer.json`` file.

    ``vocab_size`` counts added tokens too. Documents are separated by the first end-of-text
    token the vocabulary has (``_EOS_TOKENS``), else by the encoding of a blank line.
    """

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:
            raise ValueError(
                "a tokenizer.json needs the 'tokenizers' package: pip install murmuration[data]"
            ) from None
        if not Path(path).is_file():
            raise ValueError(f"tokenizer file not found: {path}")
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises its own Exception subclasses
            raise ValueError(f"{path}: not a valid tokenizer.json ({exc})") from exc
        self.path = path
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        if self.vocab_size < 1:
            raise ValueError(f"{path}: the tokenizer has an empty vocabulary")
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos = next((vocab[t] for t in _EOS_TOKENS if t in vocab), None)
        self.separator_ids: list[int] = [eos] if eos is not None else self.encode(DOC_SEPARATOR)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        out: str = self._tok.decode(list(ids), skip_special_tokens=False)
        return out


def load_tokenizer(path: str) -> ByteTokenizer | HFTokenizer:
    """The byte-level tokenizer for ``""``, else the ``tokenizer.json`` at ``path``."""
    return HFTokenizer(path) if path else ByteTokenizer()
