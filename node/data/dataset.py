"""Training batches: splits, shards, packing and the head stage's dataset.

Owns turning documents into token batches for the head stage (which holds the data loader
and tokenizer, SWARM's "trainer" role): the fixed eval split and disjoint train shards by a
stable document hash, packing each split's documents into fixed-length sequences, random
training sequences and fixed eval sequences (``TextDataset``), and ``open_dataset``: all of
that from a ``DataConfig``, checked before training starts. Does not own reading corpora
(``node.data.documents``, ``node.data.stdlib_corpus``), the model, the training loop or
anything on the wire.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from node.data.documents import Document, load_documents
from node.data.stdlib_corpus import embedded_corpus
from node.data.tokenizer import (
    DOC_SEPARATOR,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

_EVAL_BUCKETS = 10_000


def doc_bucket(doc_id: str, num_buckets: int) -> int:
    """A stable bucket in ``0..num_buckets-1`` (blake2b; Python's ``hash()`` is salted)."""
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    digest = hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_buckets


def split_documents(
    docs: Sequence[Document], *, eval_fraction: float, shard: int, num_shards: int
) -> tuple[list[Document], list[Document]]:
    """``(train shard, eval split)``: the eval split is the same for every shard; train
    shards are disjoint and together hold every non-eval document."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in 0..{num_shards - 1}, got {shard}")
    eval_cut = eval_fraction * _EVAL_BUCKETS
    train: list[Document] = []
    evals: list[Document] = []
    for doc in docs:
        if doc_bucket(doc.doc_id, _EVAL_BUCKETS) < eval_cut:
            evals.append(doc)
        elif doc_bucket(doc.doc_id + "#shard", num_shards) == shard:
            train.append(doc)
    return train, evals


@dataclass(frozen=True)
class DataConfig:
    """Where the head stage's text comes from and how it is cut into batches."""

    path: str | None = None
    """Corpus: a .txt/.jsonl/.parquet file, directory or glob, or hf:NAME_OR_DIR (Hugging
    Face datasets); None for the embedded stdlib corpus."""

    text_field: str = "text"
    """Field holding the text in .jsonl records, Parquet columns and hf: datasets."""

    tokenizer: str = ""
    """Path of a Hugging Face tokenizer.json; empty for the byte-level tokenizer. With one,
    model.vocab_size is raised to the tokenizer's vocabulary size (every node of the swarm
    needs the same setting, since the vocabulary size is part of the model fingerprint)."""

    hf_split: str = "train"
    """Split of an hf: dataset."""

    streaming: bool = False
    """Stream an hf: dataset instead of downloading it whole (pair with max_documents)."""

    max_documents: int = 0
    """Read at most this many documents of an hf: dataset (0: all)."""

    eval_fraction: float = 0.02
    """Fraction of documents (by stable hash) held out for evaluation, same on every node."""

    num_shards: int = 4
    """Number of disjoint train shards; each head node trains on one."""

    shard: int = -1
    """This head node's shard; -1 derives it from the node's peer id."""

    seq_len: int = 128
    """Tokens per training sequence."""

    batch_size: int = 16
    """Sequences per microbatch."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(
                f"DataConfig.eval_fraction must be in [0, 1), got {self.eval_fraction}"
            )
        if not -1 <= self.shard < self.num_shards:
            raise ValueError(
                f"DataConfig.shard must be -1 or in [0, {self.num_shards}), got {self.shard}"
            )
        for name in ("num_shards", "seq_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"DataConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_documents < 0:
            raise ValueError(f"DataConfig.max_documents must be >= 0, got {self.max_documents}")


def model_vocab_size(data: DataConfig, vocab_size: int) -> int:
    """The model's vocabulary size for ``data``: ``vocab_size`` raised to the tokenizer's
    (a larger one is kept: its extra rows are never used). Reads the tokenizer file."""
    if not data.tokenizer:
        return vocab_size
    return max(vocab_size, load_tokenizer(data.tokenizer).vocab_size)


def _tokenize(docs: Sequence[Document], tokenizer: Tokenizer) -> Tensor:
    """Every document's tokens, documents separated, as one flat tensor."""
    if isinstance(tokenizer, ByteTokenizer):  # fast path: no Python list of ints
        text = DOC_SEPARATOR.join(d.text for d in docs)
        return (
            torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
            if text
            else (torch.empty(0, dtype=torch.uint8))
        )
    dtype = torch.uint8 if tokenizer.vocab_size <= 256 else torch.int32
    if isinstance(tokenizer, HFTokenizer):
        ids: list[int] = []
        for i, doc_ids in enumerate(tokenizer.encode_batch([d.text for d in docs])):
            if i:
                ids.extend(tokenizer.separator_ids)
            ids.extend(doc_ids)
        return torch.tensor(ids, dtype=dtype)
    return torch.tensor(tokenizer.encode(DOC_SEPARATOR.join(d.text for d in docs)), dtype=dtype)


def pack(tokens: Tensor, seq_len: int) -> Tensor:
    """Cut a flat token stream into ``[n, seq_len + 1]`` rows, row ``i`` starting at token
    ``i * seq_len``: consecutive rows share one token, so every token after the first is a
    label exactly once. The tail shorter than a row is left out."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    num_rows = max(0, (tokens.numel() - 1) // seq_len)
    return (
        tokens.as_strided((num_rows, seq_len + 1), (seq_len, 1))
        if num_rows
        else (tokens.new_empty((0, seq_len + 1)))
    )


class TextDataset:
    """One head node's view of the corpus: its train shard and the shared eval split, each
    packed into fixed-length sequences (documents concatenated with a separator, then cut)."""

    def __init__(
        self,
        docs: Sequence[Document],
        tokenizer: Tokenizer,
        *,
        eval_fraction: float,
        shard: int,
        num_shards: int,
        seed: int,
        seq_len: int | None = None,
    ) -> None:
        """``seed`` orders the train documents before concatenation; the eval split keeps
        the given order. With ``seq_len``, both splits are checked to hold a sequence now."""
        train, evals = split_documents(
            docs, eval_fraction=eval_fraction, shard=shard, num_shards=num_shards
        )
        random.Random(seed).shuffle(train)
        self.train_doc_ids = tuple(d.doc_id for d in train)
        self.eval_doc_ids = tuple(d.doc_id for d in evals)
        self.num_shards = num_shards
        self.vocab_size = tokenizer.vocab_size
        self.train_tokens = _tokenize(train, tokenizer)
        self.eval_tokens = _tokenize(evals, tokenizer)
        if seq_len is not None:
            self._rows("train", seq_len)
            if eval_fraction > 0:
                self._rows("eval", seq_len)

    @property
    def num_train_tokens(self) -> int:
        return self.train_tokens.numel()

    @property
    def num_eval_tokens(self) -> int:
        return self.eval_tokens.numel()

    def _rows(self, split: str, seq_len: int) -> Tensor:
        """The split packed into rows of ``seq_len + 1``; ``ValueError`` if it has none."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        tokens = self.train_tokens if split == "train" else self.eval_tokens
        if tokens.numel() < seq_len + 1:
            hint = "fewer shards" if split == "train" else "a larger eval_fraction"
            raise ValueError(
                f"the {split} split has {tokens.numel()} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}; use {hint}, a shorter seq_len or a bigger corpus "
                f"(num_shards={self.num_shards})"
            )
        return pack(tokens, seq_len)

    @staticmethod
    def _split_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
        chunk = rows.long()
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def sample_batch(
        self, rng: torch.Generator, batch_size: int, seq_len: int
    ) -> tuple[Tensor, Tensor]:
        """Random packed train sequences: ``ids, labels`` int64 ``[batch_size, seq_len]``,
        labels being ids shifted left by one token."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rows = self._rows("train", seq_len)
        picks = torch.randint(0, rows.shape[0], (batch_size,), generator=rng)
        return self._split_rows(rows[picks])

    def eval_batches(
        self, num_batches: int, batch_size: int, seq_len: int
    ) -> list[tuple[Tensor, Tensor]]:
        """Fixed packed sequences evenly spread over the eval split (from its first to its
        last full sequence), the same on every call and node."""
        if num_batches < 1 or batch_size < 1:
            raise ValueError(
                f"num_batches and batch_size must be >= 1, got {num_batches}, {batch_size}"
            )
        rows = self._rows("eval", seq_len)
        num_picks = num_batches * batch_size
        picks = torch.arange(num_picks) * (rows.shape[0] - 1) // max(num_picks - 1, 1)
        return [
            self._split_rows(rows[picks[i * batch_size : (i + 1) * batch_size]])
            for i in range(num_batches)
        ]


def shard_of(peer_id: str, num_shards: int) -> int:
    """The train shard a head node without an explicit ``data.shard`` takes: a pure function
    of its peer id (keep the id across restarts with ``--state-dir``), so a node's shard never
    depends on which other nodes are up."""
    return int(peer_id[:8], 16) % num_shards


def open_dataset(data: DataConfig, *, shard: int, seed: int, vocab_size: int) -> TextDataset:
    """The head node's dataset for ``data`` (the embedded corpus when ``data.path`` is None),
    checked before training: readable, non-empty, each split holding a sequence, and every
    token id below the model's ``vocab_size``. Raises ``ValueError`` with the reason."""
    tokenizer = load_tokenizer(data.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is "
            f"{vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}"
        )
    if data.path:
        docs = load_documents(
            data.path,
            data.text_field,
            hf_split=data.hf_split,
            streaming=data.streaming,
            max_documents=data.max_documents,
        )
    else:
        docs = embedded_corpus()
    return TextDataset(
        docs,
        tokenizer,
        eval_fraction=data.eval_fraction,
        shard=shard,
        num_shards=data.num_shards,
        seed=seed,
        seq_len=data.seq_len,
    )
