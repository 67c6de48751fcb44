"""Tests for node/data/: tokenizer, embedded corpus, loading, splits and batches."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from node.data import stdlib_corpus
from node.data.dataset import DataConfig, TextDataset, doc_bucket, split_documents
from node.data.documents import Document, load_documents
from node.data.stdlib_corpus import embedded_corpus
from node.data.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[Document]:
    cache_dir = tmp_path_factory.mktemp("cache")
    start = time.perf_counter()
    docs = embedded_corpus(cache_dir)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    cached = embedded_corpus(cache_dir)
    cached_s = time.perf_counter() - start
    size = sum(len(d.text.encode()) for d in docs)
    print(
        f"\nembedded corpus: {len(docs)} docs, {size} bytes, cold {cold_s:.2f} s, cached {cached_s:.3f} s"
    )
    assert cached == docs
    assert len(list(cache_dir.iterdir())) == 1
    return docs


def _docs(n: int, length: int = 50) -> list[Document]:
    return [Document(f"doc{i}", f"document {i} " + "x" * length) for i in range(n)]


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld — 日本語 🐦"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"


def test_embedded_corpus(corpus: list[Document]) -> None:
    size = sum(len(d.text.encode()) for d in corpus)
    assert 1_500_000 < size < 6_000_000
    assert len({d.doc_id for d in corpus}) == len(corpus)
    assert all(d.doc_id.startswith("stdlib:") and len(d.text) >= 80 for d in corpus)
    assert not any("/test/" in d.doc_id or "idlelib/" in d.doc_id for d in corpus)
    text = " ".join(d.text for d in corpus[::10])
    assert sum(c.isascii() for c in text) / len(text) > 0.99
    words = text.lower().split()
    assert words.count("the") / len(words) > 0.03


def test_embedded_corpus_deterministic(corpus: list[Document], tmp_path: Path) -> None:
    again = embedded_corpus(tmp_path)  # a second cold build
    assert [d.doc_id for d in again] == [d.doc_id for d in corpus]
    assert again == corpus


def test_embedded_corpus_unwritable_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = [Document("stdlib:x.py:<module>", "y" * 100)]
    monkeypatch.setattr(stdlib_corpus, "_build_stdlib_corpus", lambda: list(fake))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert embedded_corpus(blocker / "cache") == fake  # built in memory, no error
    assert embedded_corpus(tmp_path / "cache") == fake
    fake.append(Document("stdlib:z.py:<module>", "z" * 100))
    assert len(embedded_corpus(tmp_path / "cache")) == 1  # read back from the cache


def test_load_txt_jsonl_dir_glob(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha text", encoding="utf-8")
    (tmp_path / "sub" / "b.txt").write_text("béta", encoding="utf-8")
    lines = [json.dumps({"body": "one"}), "", json.dumps({"body": "two", "x": 1})]
    (tmp_path / "sub" / "c.jsonl").write_text("\n".join(lines), encoding="utf-8")
    (tmp_path / "ignored.md").write_text("nope")

    assert load_documents(str(tmp_path / "a.txt")) == [Document("a.txt", "alpha text")]
    assert load_documents(str(tmp_path / "sub" / "c.jsonl"), text_field="body") == [
        Document("c.jsonl:1", "one"),
        Document("c.jsonl:3", "two"),
    ]
    by_dir = load_documents(str(tmp_path), text_field="body")
    assert [d.doc_id for d in by_dir] == ["a.txt", "sub/b.txt", "sub/c.jsonl:1", "sub/c.jsonl:3"]
    by_glob = load_documents(str(tmp_path / "**" / "*.txt"))
    assert [d.doc_id for d in by_glob] == ["a.txt", "sub/b.txt"]
    assert by_glob[1].text == "béta"


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        load_documents(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="no .txt, .jsonl or .parquet files match"):
        load_documents(str(tmp_path / "*.txt"))
    with pytest.raises(ValueError, match="no .txt, .jsonl or .parquet files under"):
        load_documents(str(tmp_path))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe")
    with pytest.raises(ValueError, match=r"bad\.txt.*UTF-8"):
        load_documents(str(bad))
    bad.unlink()
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not valid JSON"):
        load_documents(str(jsonl))
    jsonl.write_text('{"text": "fine"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: no string field 'text'"):
        load_documents(str(jsonl))
    jsonl.write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="empty"):
        load_documents(str(jsonl))


def test_doc_bucket_stable() -> None:
    assert doc_bucket("stdlib:json/__init__.py:<module>", 10_000) == doc_bucket(
        "stdlib:json/__init__.py:<module>", 10_000
    )
    assert doc_bucket("abc", 1_000_000) == 453_721  # pinned: must never change
    buckets = [doc_bucket(f"d{i}", 4) for i in range(400)]
    assert set(buckets) == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        doc_bucket("x", 0)


def test_shards_disjoint_complete_and_eval_shared() -> None:
    docs = _docs(500)
    splits = [split_documents(docs, eval_fraction=0.1, shard=s, num_shards=4) for s in range(4)]
    evals = [tuple(d.doc_id for d in e) for _, e in splits]
    assert len(set(evals)) == 1 and 20 < len(evals[0]) < 90
    trains = [{d.doc_id for d in t} for t, _ in splits]
    assert sum(len(t) for t in trains) == len(set().union(*trains))
    assert set().union(*trains) | set(evals[0]) == {d.doc_id for d in docs}
    datasets = [
        TextDataset(docs, ByteTokenizer(), eval_fraction=0.1, shard=s, num_shards=4, seed=0)
        for s in range(4)
    ]
    assert len({ds.eval_doc_ids for ds in datasets}) == 1
    assert all(torch.equal(ds.eval_tokens, datasets[0].eval_tokens) for ds in datasets)
    assert [set(ds.train_doc_ids) for ds in datasets] == trains
    with pytest.raises(ValueError, match="shard"):
        split_documents(docs, eval_fraction=0.1, shard=4, num_shards=4)
    with pytest.raises(ValueError, match="eval_fraction"):
        DataConfig(eval_fraction=1.0)


def test_sample_batch() -> None:
    docs = _docs(40)
    ds = TextDataset(docs, ByteTokenizer(), eval_fraction=0.2, shard=0, num_shards=1, seed=0)
    num_train, num_eval = len(ds.train_doc_ids), len(ds.eval_doc_ids)
    assert num_train + num_eval == 40 and num_eval > 0
    separators = 2 * (num_train - 1) + 2 * (num_eval - 1)
    assert ds.num_train_tokens + ds.num_eval_tokens == sum(len(d.text) for d in docs) + separators
    ids, labels = ds.sample_batch(torch.Generator().manual_seed(0), 8, 32)
    assert ids.shape == labels.shape == (8, 32)
    assert ids.dtype == labels.dtype == torch.int64
    assert torch.equal(ids[:, 1:], labels[:, :-1])
    again, _ = ds.sample_batch(torch.Generator().manual_seed(0), 8, 32)
    assert torch.equal(ids, again)
    text = ByteTokenizer().decode(ids[0].tolist() + labels[0, -1:].tolist())
    assert text in ByteTokenizer().decode(ds.train_tokens.tolist())


def test_eval_batches_deterministic() -> None:
    docs = _docs(200)
    a = TextDataset(docs, ByteTokenizer(), eval_fraction=0.1, shard=0, num_shards=2, seed=0)
    b = TextDataset(docs, ByteTokenizer(), eval_fraction=0.1, shard=1, num_shards=2, seed=5)
    batches_a = a.eval_batches(3, 4, 16)
    batches_b = b.eval_batches(3, 4, 16)
    assert len(batches_a) == 3
    for (ids_a, lab_a), (ids_b, lab_b) in zip(batches_a, batches_b, strict=True):
        assert ids_a.shape == (4, 16) and ids_a.dtype == torch.int64
        assert torch.equal(ids_a, ids_b) and torch.equal(lab_a, lab_b)
        assert torch.equal(ids_a[:, 1:], lab_a[:, :-1])
    # The packed sequences span the eval split: the first at its start, the last ending
    # within one sequence of its end.
    assert torch.equal(batches_a[0][0][0], a.eval_tokens[:16].long())
    num_rows = (a.num_eval_tokens - 1) // 16
    assert torch.equal(
        batches_a[-1][1][-1], a.eval_tokens[num_rows * 16 - 15 : num_rows * 16 + 1].long()
    )
    assert a.num_eval_tokens - (num_rows * 16 + 1) < 16


def test_too_small_split() -> None:
    docs = _docs(8, length=5)
    with pytest.raises(ValueError, match="train split.*fewer shards"):
        TextDataset(
            docs, ByteTokenizer(), eval_fraction=0.0, shard=0, num_shards=8, seed=0, seq_len=64
        )
    ds = TextDataset(docs, ByteTokenizer(), eval_fraction=0.0, shard=0, num_shards=1, seed=0)
    with pytest.raises(ValueError, match="eval split has 0 tokens"):
        ds.eval_batches(1, 1, 8)
    with pytest.raises(ValueError, match="train split"):
        ds.sample_batch(torch.Generator(), 2, 10_000)
