"""Documents: the unit of text a corpus is made of, and reading user corpora.

Owns ``Document`` (a stable id plus its text; the id decides a document's split and shard)
and ``load_documents`` for user corpora: .txt (one document), .jsonl (one per line), Parquet
(one per row), directories and globs of those, and Hugging Face ``datasets`` with
``hf:NAME_OR_DIR``. Parquet needs ``pyarrow`` and ``hf:`` needs ``datasets`` (the optional
``data`` extra, ``pip install murmuration[data]``), imported only when used. Does not own the
embedded default corpus (``node.data.stdlib_corpus``) nor splits and packing
(``node.data.dataset``).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Document:
    doc_id: str
    """Stable identifier; decides the document's eval/train split and shard."""

    text: str
    """The document's text."""


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
