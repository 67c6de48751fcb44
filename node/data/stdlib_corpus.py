"""The embedded default corpus: English prose from the Python standard library.

Owns building and caching the corpus a swarm trains on when no ``data.path`` is given, so a
swarm needs no download: the docstrings (module, class, function) of the standard library
plus pydoc's topic texts. It depends on the Python version (its standard library's
docstrings), so two head nodes see the same corpus, and the same eval split, only when they
run the same Python version; the cache is keyed by that version.
"""

from __future__ import annotations

import ast
import gzip
import inspect
import json
import logging
import os
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

from node.data.documents import Document

log = logging.getLogger(__name__)

_MIN_DOCSTRING_CHARS = 80
_SKIPPED_STDLIB_DIRS = frozenset(
    {"tests", "test", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo"}
)
# The Language Reference excerpts pydoc ships as plain text; added to the docstrings because
# those alone give only ~1.5 MB on CPython 3.11.
_PYDOC_TOPICS = "pydoc_data/topics.py"
# Bump when the corpus recipe changes, so stale caches are not read.
_CORPUS_FORMAT = 1


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/murmuration``, or ``~/.cache/murmuration``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "murmuration"


def _py_files(root: Path) -> list[str]:
    """Relative posix paths of the .py files under ``root`` outside the skipped dirs, sorted."""
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


def docstring_documents(root: Path, prefix: str, topics: str | None = None) -> list[Document]:
    """A document for every docstring of at least ``_MIN_DOCSTRING_CHARS`` in the .py files
    under ``root`` (and, for the file ``topics``, pydoc's topic texts), ids ``prefix:path:name``."""
    docs: list[Document] = []
    seen: set[str] = set()
    for rel in _py_files(root):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes in old sources
                tree = ast.parse((root / rel).read_bytes(), filename=rel)
        except (SyntaxError, ValueError, OSError, RecursionError):
            continue
        pieces = _pydoc_topics(tree) if rel == topics else _docstrings(tree)
        for qualname, raw in pieces:
            text = inspect.cleandoc(raw)
            if len(text) < _MIN_DOCSTRING_CHARS:
                continue
            doc_id = f"{prefix}:{rel}:{qualname}"
            # Conditional definitions (if/else, try/except) can repeat a qualname.
            base, n = doc_id, 1
            while doc_id in seen:
                n += 1
                doc_id = f"{base}#{n}"
            seen.add(doc_id)
            docs.append(Document(doc_id, text))
    return docs


def _build_stdlib_corpus() -> list[Document]:
    return docstring_documents(Path(sysconfig.get_paths()["stdlib"]), "stdlib", _PYDOC_TOPICS)


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
