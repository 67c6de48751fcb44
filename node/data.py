"""Training text: the byte tokenizer, the embedded default corpus, loading and sharding.

Owns turning text into token batches for the head stage (ALGORITHMS.md section 1: the head
stage holds the data loader and tokenizer): ``ByteTokenizer``; ``embedded_corpus``, English
prose from the docstrings of the Python standard library, so a swarm can train with no
download; ``load_documents`` for user corpora (.txt, .jsonl, directories, globs); the fixed
eval split and disjoint train shards by stable document hash; ``TextDataset`` with random
training windows and deterministic eval windows. Does not own the model, the training loop,
curricula or anything on the wire.

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
from typing import Protocol

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

_SUFFIXES = (".txt", ".jsonl")


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


def _glob_base(pattern: str) -> Path:
    """The directory part of ``pattern`` before its first wildcard."""
    parts = Path(pattern).parts
    first_magic = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    return Path(*parts[:first_magic]) if first_magic else Path(".")


def load_documents(path: str, text_field: str = "text") -> list[Document]:
    """Documents from a .txt file (one document), a .jsonl file (one per line, text under
    ``text_field``), a directory (every .txt/.jsonl under it, recursive, sorted) or a glob.

    ``doc_id`` is the file path relative to the directory (or glob prefix, or the file's own
    directory), plus ``:<line>`` for jsonl, so it is the same on every node.
    """
    target = Path(path)
    if target.is_file():
        if target.suffix not in _SUFFIXES:
            raise ValueError(f"{path}: unsupported file type; expected .txt or .jsonl")
        base, files = target.parent, [target]
    elif target.is_dir():
        base = target
        files = sorted(p for p in target.rglob("*") if p.suffix in _SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"no .txt or .jsonl files under directory {path}")
    elif glob.has_magic(path):
        base = _glob_base(path)
        matches = (Path(p) for p in glob.glob(path, recursive=True))
        files = sorted(p for p in matches if p.suffix in _SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"no .txt or .jsonl files match {path!r}")
    else:
        raise ValueError(f"corpus path not found: {path}")

    docs: list[Document] = []
    for file in files:
        doc_id = file.relative_to(base).as_posix()
        if file.suffix == ".jsonl":
            docs.extend(_read_jsonl(file, doc_id, text_field))
        else:
            docs.append(Document(doc_id, _read_text(file)))
    docs = [d for d in docs if d.text]
    if not docs:
        raise ValueError(f"corpus at {path} is empty: every document has empty text")
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
    """Corpus file, directory or glob (.txt / .jsonl); None for the embedded stdlib corpus."""

    text_field: str = "text"
    """Field holding the text in .jsonl records."""

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


def _tokenize(docs: Sequence[Document], tokenizer: Tokenizer) -> Tensor:
    text = _DOC_SEPARATOR.join(d.text for d in docs)
    if isinstance(tokenizer, ByteTokenizer) and text:  # fast path: no Python list of ints
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    dtype = torch.uint8 if tokenizer.vocab_size <= 256 else torch.int32
    return torch.tensor(tokenizer.encode(text), dtype=dtype)


class TextDataset:
    """One head node's view of the corpus: its train shard and the shared eval split."""

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
        the given order. With ``seq_len``, both splits are checked to hold a window now."""
        train, evals = split_documents(
            docs, eval_fraction=eval_fraction, shard=shard, num_shards=num_shards
        )
        random.Random(seed).shuffle(train)
        self.train_doc_ids = tuple(d.doc_id for d in train)
        self.eval_doc_ids = tuple(d.doc_id for d in evals)
        self.num_shards = num_shards
        self.train_tokens = _tokenize(train, tokenizer)
        self.eval_tokens = _tokenize(evals, tokenizer)
        if seq_len is not None:
            self._check_split("train", seq_len)
            if eval_fraction > 0:
                self._check_split("eval", seq_len)

    @property
    def num_train_tokens(self) -> int:
        return self.train_tokens.numel()

    @property
    def num_eval_tokens(self) -> int:
        return self.eval_tokens.numel()

    def _check_split(self, split: str, seq_len: int) -> Tensor:
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
        return tokens

    @staticmethod
    def _windows(tokens: Tensor, starts: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
        chunk = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def sample_batch(
        self, rng: torch.Generator, batch_size: int, seq_len: int
    ) -> tuple[Tensor, Tensor]:
        """Random train windows: ``ids, labels`` int64 ``[batch_size, seq_len]``, labels
        being ids shifted left by one token."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        tokens = self._check_split("train", seq_len)
        starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=rng)
        return self._windows(tokens, starts, seq_len)

    def eval_batches(
        self, num_batches: int, batch_size: int, seq_len: int
    ) -> list[tuple[Tensor, Tensor]]:
        """Fixed windows evenly spaced over the eval split, the same on every call and node."""
        if num_batches < 1 or batch_size < 1:
            raise ValueError(
                f"num_batches and batch_size must be >= 1, got {num_batches}, {batch_size}"
            )
        tokens = self._check_split("eval", seq_len)
        num_windows = num_batches * batch_size
        last_start = tokens.numel() - seq_len - 1
        starts = torch.arange(num_windows) * last_start // max(num_windows - 1, 1)
        return [
            self._windows(tokens, starts[i * batch_size : (i + 1) * batch_size], seq_len)
            for i in range(num_batches)
        ]
