"""Tokenizers: text to token ids and back.

Owns the byte-level default (``ByteTokenizer``: UTF-8 bytes, lossless, no vocabulary file),
the same tokenizer written as a Hugging Face ``tokenizer.json`` (``save_byte_tokenizer``,
for exports other libraries load), and a ``tokenizer.json`` read by path (``HFTokenizer``).
Both of the latter need the ``tokenizers`` package of the optional ``data`` extra, imported
only when used.
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


def _byte_chars() -> list[str]:
    """The printable character GPT-2's byte-level BPE writes for each byte value (Radford et
    al. 2019, ``encoder.py`` ``bytes_to_unicode``): printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + shifted))
            shifted += 1
    return chars


def save_byte_tokenizer(path: str | Path) -> None:
    """Write ``ByteTokenizer`` as a ``tokenizers`` ``tokenizer.json``: a byte-level BPE with
    the 256 byte symbols as its vocabulary (id = byte value) and no merges, so it encodes any
    text to exactly ``ByteTokenizer``'s ids and decodes them back the same way."""
    try:
        from tokenizers import Tokenizer as _HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers
    except ImportError:
        raise ValueError(
            "writing tokenizer.json needs the 'tokenizers' package: pip install murmuration[data]"
        ) from None
    vocab = {char: byte for byte, char in enumerate(_byte_chars())}
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))


# Tokens that end a document, and that begin one, in the order they are looked for in a
# tokenizer.json.
_EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
_BOS_TOKENS = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")


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
        self.eos_token: str | None = next((t for t in _EOS_TOKENS if t in vocab), None)
        """The end-of-text token, if the vocabulary has one (``_EOS_TOKENS``)."""
        self.bos_token: str | None = next((t for t in _BOS_TOKENS if t in vocab), None)
        """The beginning-of-text token, if the vocabulary has one (``_BOS_TOKENS``)."""
        self.eos_id = None if self.eos_token is None else vocab[self.eos_token]
        self.bos_id = None if self.bos_token is None else vocab[self.bos_token]
        self.separator_ids: list[int] = (
            [self.eos_id] if self.eos_id is not None else self.encode(DOC_SEPARATOR)
        )

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
