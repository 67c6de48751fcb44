"""Training text: the byte tokenizer, the embedded default corpus, loading and sharding.

Owns turning text into token batches for the head stage (ALGORITHMS.md section 1: the head
stage holds the data loader and tokenizer): ``ByteTokenizer`` (the default) and a Hugging
Face ``tokenizer.json`` by path (``load_tokenizer``); ``embedded_corpus``, English prose from
the docstrings of the Python standard library, so a swarm can train with no download;
``load_documents`` for user corpora (.txt, .jsonl, Parquet, directories, globs, and Hugging
Face ``datasets`` with ``hf:NAME_OR_DIR``); the fixed eval split and disjoint train shards by
stable document hash; ``TextDataset``, which packs each split's documents into fixed-length
sequences and serves random training sequences and fixed eval sequences; ``open_dataset``,
all of that from a ``DataConfig``, checked before training starts. Does not own the model,
the training loop, curricula or anything on the wire.

Parquet needs ``pyarrow``, ``hf:`` needs ``datasets`` and ``tokenizer.json`` needs
``tokenizers``: the optional ``data`` extra (``pip install murmuration[data]``). They are
imported only when used, so the byte-level default works without them.

The embedded corpus depends on the Python version (its standard library's docstrings), so
two head nodes only see the same corpus, and the same eval split, when they run the same
Python version; the cache is keyed by that version.
"""

from __future__ import annotations

import ast
import glob
import gzip
import hashlib
import inspect
import json
import logging
import os
import random
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

log = logging.getLogger(__name__)

_EVAL_BUCKETS = 10_000
_DOC_SEPARATOR = "\n\n"
_MIN_DOCSTRING_CHARS = 80
_SKIPPED_STDLIB_DIRS = frozenset(
    {"tests", "test", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo"}
)
# The Language Reference excerpts pydoc ships as plain text; added to the docstrings because
# those alone give only ~1.5 MB on CPython 3.11.
_PYDOC_TOPICS = "pydoc_data/topics.py"
# Bump when the corpus recipe changes, so stale caches are not read.
_CORPUS_FORMAT = 1


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
        self.separator_ids: list[int] = [eos] if eos is not None else self.encode(_DOC_SEPARATOR)

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


@dataclass(frozen=True)
class Document:
    doc_id: str
    """Stable identifier; decides the document's eval/train split and shard."""

    text: str
    """The document's text."""


# ---------------------------------------------------------------------------------------
# The embedded corpus


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/murmuration``, or ``~/.cache/murmuration``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "murmuration"


def _stdlib_files(root: Path) -> list[str]:
    """Relative posix paths of the stdlib's .py files outside the skipped dirs, sorted."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_STDLIB_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        found.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(found)


def _docstrings(tree: ast.Module) -> Iterator[tuple[str, str]]:
    """(qualname, raw docstring) of the module and every class and function, nested too."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                qualname = prefix + child.name
                doc = ast.get_docstring(child, clean=False)
                if doc:
                    yield qualname, doc
                inner = ".<locals>." if not isinstance(child, ast.ClassDef) else "."
                yield from walk(child, qualname + inner)
            else:
                yield from walk(child, prefix)

    doc = ast.get_docstring(tree, clean=False)
    if doc:
        yield "<module>", doc
    yield from walk(tree, "")


def _pydoc_topics(tree: ast.Module) -> Iterator[tuple[str, str]]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and isinstance(key.value, str)
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, str)
                ):
                    yield f"topics[{key.value}]", value.value


def _build_stdlib_corpus() -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[Document] = []
    seen: set[str] = set()
    for rel in _stdlib_files(root):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes in old stdlib sources
                tree = ast.parse((root / rel).read_bytes(), filename=rel)
        except (SyntaxError, ValueError, OSError, RecursionError):
            continue
        pieces = _pydoc_topics(tree) if rel == _PYDOC_TOPICS else _docstrings(tree)
        for qualname, raw in pieces:
            text = inspect.cleandoc(raw)
            if len(text) < _MIN_DOCSTRING_CHARS:
                continue
            doc_id = f"stdlib:{rel}:{qualname}"
            # Conditional definitions (if/else, try/except) can repeat a qualname.
            base, n = doc_id, 1
            while doc_id in seen:
                n += 1
                doc_id = f"{base}#{n}"
            seen.add(doc_id)
            docs.append(Document(doc_id, text))
    return docs


def _corpus_cache_path(cache_dir: Path) -> Path:
    impl = sys.implementation.name
    version = ".".join(map(str, sys.version_info[:3]))
    return cache_dir / f"stdlib-corpus-{impl}{version}-v{_CORPUS_FORMAT}.jsonl.gz"


def _read_cache(path: Path) -> list[Document] | None:
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [Document(**json.loads(line)) for line in f]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, EOFError) as exc:
        log.warning("ignoring unreadable corpus cache %s: %s", path, exc)
        return None


def _write_cache(path: Path, docs: list[Document]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as raw, gzip.open(raw, "wt", encoding="utf-8") as f:
                for doc in docs:
                    f.write(json.dumps({"doc_id": doc.doc_id, "text": doc.text}) + "\n")
            os.replace(tmp, path)  # atomic: concurrent nodes never read a half file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.info("corpus cache dir %s not writable (%s); keeping the corpus in memory", path, exc)


def embedded_corpus(cache_dir: Path | None = None) -> list[Document]:
    """The default corpus: docstrings (module, class, function) of the stdlib, plus pydoc's
    topic texts, each of at least 80 characters; about 1.9 MB in ~4,200 documents on CPython
    3.11. ``doc_id`` is ``stdlib:<relpath>:<qualname>``.

    Parsing the stdlib takes ~3 s, so the result is cached as gzip'd JSON lines under
    ``cache_dir`` (default ``default_cache_dir()``), keyed by Python version; an unwritable
    cache dir only means building in memory every time. Depends on the Python version.
    """
    path = _corpus_cache_path(cache_dir if cache_dir is not None else default_cache_dir())
    docs = _read_cache(path)
    if docs is None:
        docs = _build_stdlib_corpus()
        _write_cache(path, docs)
    return docs


# ---------------------------------------------------------------------------------------
# User corpora

_SUFFIXES = (".txt", ".jsonl", ".parquet")
_HF_PREFIX = "hf:"


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from exc


def _read_jsonl(path: Path, doc_id: str, text_field: str) -> list[Document]:
    docs: list[Document] = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ValueError(f"{path}:{number}: no string field {text_field!r}")
        docs.append(Document(f"{doc_id}:{number}", record[text_field]))
    return docs


def _read_parquet(path: Path, doc_id: str, text_field: str) -> list[Document]:
    """One document per row of column ``text_field``; ``doc_id`` gets ``:<row>`` (from 0)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"{path}: Parquet needs the 'pyarrow' package: pip install murmuration[data]"
        ) from None
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise ValueError(f"{path}: cannot read as Parquet ({exc})") from exc
    if text_field not in table.column_names:
        raise ValueError(
            f"{path}: no column {text_field!r}; columns: {', '.join(table.column_names)}"
        )
    column = table.column(text_field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"{path}: column {text_field!r} holds {column.type}, not strings")
    return [
        Document(f"{doc_id}:{row}", text)
        for row, text in enumerate(column.to_pylist())
        if text is not None
    ]


def _glob_base(pattern: str) -> Path:
    """The directory part of ``pattern`` before its first wildcard."""
    parts = Path(pattern).parts
    first_magic = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    return Path(*parts[:first_magic]) if first_magic else Path(".")


def load_documents(
    path: str,
    text_field: str = "text",
    *,
    hf_split: str = "train",
    streaming: bool = False,
    max_documents: int = 0,
) -> list[Document]:
    """Documents from a .txt file (one document), a .jsonl file (one per line, text under
    ``text_field``), a Parquet file (one per row of column ``text_field``), a directory
    (every such file under it, recursive, sorted), a glob, or ``hf:NAME_OR_DIR`` (see
    ``load_hf_documents``; ``hf_split``, ``streaming`` and ``max_documents`` apply to it).

    ``doc_id`` is the file path relative to the directory (or glob prefix, or the file's own
    directory), plus ``:<line>`` for jsonl and ``:<row>`` for Parquet, so it is the same on
    every node.
    """
    if path.startswith(_HF_PREFIX):
        return load_hf_documents(
            path[len(_HF_PREFIX) :],
            text_field,
            split=hf_split,
            streaming=streaming,
            max_documents=max_documents,
        )
    target = Path(path)
    kinds = ".txt, .jsonl or .parquet"
    if target.is_file():
        if target.suffix not in _SUFFIXES:
            raise ValueError(f"{path}: unsupported file type; expected {kinds}")
        base, files = target.parent, [target]
    elif target.is_dir():
        base = target
        files = sorted(p for p in target.rglob("*") if p.suffix in _SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"no {kinds} files under directory {path}")
    elif glob.has_magic(path):
        base = _glob_base(path)
        matches = (Path(p) for p in glob.glob(path, recursive=True))
        files = sorted(p for p in matches if p.suffix in _SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"no {kinds} files match {path!r}")
    else:
        raise ValueError(f"corpus path not found: {path}")

    docs: list[Document] = []
    for file in files:
        doc_id = file.relative_to(base).as_posix()
        if file.suffix == ".jsonl":
            docs.extend(_read_jsonl(file, doc_id, text_field))
        elif file.suffix == ".parquet":
            docs.extend(_read_parquet(file, doc_id, text_field))
        else:
            docs.append(Document(doc_id, _read_text(file)))
    docs = [d for d in docs if d.text]
    if not docs:
        raise ValueError(f"corpus at {path} is empty: every document has empty text")
    return docs


def load_hf_documents(
    name: str, text_field: str, *, split: str, streaming: bool, max_documents: int
) -> list[Document]:
    """Documents from a Hugging Face dataset: a directory written by ``save_to_disk``, a
    local dataset directory or data files, or a Hub name (downloaded by ``datasets``, or
    streamed with ``streaming``). ``doc_id`` is ``hf:<split>:<index>``, the record's position
    in the split, so every node that reads the same dataset agrees on it. ``max_documents``
    (0: all) bounds what is read, which a streamed corpus usually needs.
    """
    try:
        import datasets
    except ImportError:
        raise ValueError(
            "hf: corpora need the 'datasets' package: pip install murmuration[data]"
        ) from None
    where = f"{_HF_PREFIX}{name}"
    try:
        if (Path(name) / "dataset_info.json").is_file() or (
            Path(name) / "dataset_dict.json"
        ).is_file():
            loaded = datasets.load_from_disk(name)
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ValueError(f"{where}: no split {split!r}; splits: {', '.join(loaded)}")
                loaded = loaded[split]
            records: Iterable[Any] = loaded.to_iterable_dataset() if streaming else loaded
        else:
            records = datasets.load_dataset(name, split=split, streaming=streaming)
    except ValueError:
        raise
    except Exception as exc:  # datasets raises many unrelated types (FileNotFoundError, hub errors)
        raise ValueError(f"{where}: cannot load the dataset ({type(exc).__name__}: {exc})") from exc
    docs: list[Document] = []
    for index, record in enumerate(records):
        if max_documents and index >= max_documents:
            break
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"{where}: record {index} has no string field {text_field!r} ({fields})"
            )
        if text:
            docs.append(Document(f"hf:{split}:{index}", text))
    if not docs:
        raise ValueError(f"corpus at {where} (split {split!r}) is empty")
    return docs


# ---------------------------------------------------------------------------------------
# Splits and batches


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
        text = _DOC_SEPARATOR.join(d.text for d in docs)
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
    return torch.tensor(tokenizer.encode(_DOC_SEPARATOR.join(d.text for d in docs)), dtype=dtype)


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
