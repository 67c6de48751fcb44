"""Real data formats for node/data.py: Parquet, Hugging Face datasets, tokenizer.json,
packing, shards that stay put as head nodes come and go, and clear errors before training.

Every test builds its own small files; nothing is downloaded (the Hugging Face libraries run
offline, with their caches under the test's tmp dir).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from node.cli import with_tokenizer_vocab
from node.config import resolve_config
from node.data.dataset import (
    DataConfig,
    TextDataset,
    model_vocab_size,
    open_dataset,
    pack,
    shard_of,
    split_documents,
)
from node.data.documents import Document, load_documents
from node.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

os.environ["HF_HUB_OFFLINE"] = "1"  # never reach the Hub from a test
os.environ["HF_DATASETS_OFFLINE"] = "1"

TEXTS = [f"record number {i}: " + "the quick brown fox jumps. " * (1 + i % 5) for i in range(60)]


@pytest.fixture(autouse=True)
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))


def _write_parquet(path: Path, texts: list[str | None], column: str = "text") -> None:
    pa = pytest.importorskip("pyarrow", reason="pyarrow (the 'data' extra) is not installed")
    pq = pytest.importorskip("pyarrow.parquet")
    ids = list(range(len(texts)))
    pq.write_table(pa.table({"id": ids, column: texts}), path)


# ---- Parquet ------------------------------------------------------------------------------


def test_parquet_file_and_mixed_directory(tmp_path: Path) -> None:
    _write_parquet(tmp_path / "p.parquet", ["first row", None, "", "third row"])
    docs = load_documents(str(tmp_path / "p.parquet"))
    # Null and empty rows are skipped; ids keep the row number, so they stay stable.
    assert docs == [Document("p.parquet:0", "first row"), Document("p.parquet:3", "third row")]

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("plain text")
    (tmp_path / "sub" / "b.jsonl").write_text(json.dumps({"body": "json text"}) + "\n")
    _write_parquet(tmp_path / "sub" / "c.parquet", ["parquet text"], column="body")
    docs = load_documents(str(tmp_path / "sub"), text_field="body")
    assert [d.doc_id for d in docs] == ["a.txt", "b.jsonl:1", "c.parquet:0"]
    by_glob = load_documents(str(tmp_path / "*.parquet"))
    assert [d.doc_id for d in by_glob] == ["p.parquet:0", "p.parquet:3"]


def test_parquet_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    _write_parquet(path, ["a", "b"], column="content")
    with pytest.raises(ValueError, match=r"p\.parquet: no column 'text'; columns: id, content"):
        load_documents(str(path))
    with pytest.raises(ValueError, match=r"column 'id' holds int64, not strings"):
        load_documents(str(path), text_field="id")
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match=r"p\.parquet: cannot read as Parquet"):
        load_documents(str(path))
    _write_parquet(path, [None, ""])
    with pytest.raises(ValueError, match="empty"):
        load_documents(str(path))


# ---- Hugging Face datasets ----------------------------------------------------------------


def test_hf_saved_dataset_local_and_streaming(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="datasets (the 'data' extra) is missing")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": TEXTS, "n": list(range(len(TEXTS)))}).save_to_disk(saved)
    docs = load_documents(f"hf:{saved}")
    assert [d.text for d in docs] == TEXTS
    assert docs[7].doc_id == "hf:train:7"
    streamed = load_documents(f"hf:{saved}", streaming=True, max_documents=10)
    assert streamed == docs[:10]

    splits = tmp_path / "splits"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"body": TEXTS[:5]}),
            "validation": datasets.Dataset.from_dict({"body": TEXTS[5:8]}),
        }
    ).save_to_disk(splits)
    val = load_documents(f"hf:{splits}", text_field="body", hf_split="validation")
    assert [d.doc_id for d in val] == ["hf:validation:0", "hf:validation:1", "hf:validation:2"]
    with pytest.raises(ValueError, match="no split 'test'; splits: train, validation"):
        load_documents(f"hf:{splits}", text_field="body", hf_split="test")
    with pytest.raises(ValueError, match="record 0 has no string field 'text' \\(body\\)"):
        load_documents(f"hf:{splits}")


def test_hf_data_files_streamed(tmp_path: Path) -> None:
    pytest.importorskip("datasets", reason="datasets (the 'data' extra) is missing")
    folder = tmp_path / "files"
    folder.mkdir()
    lines = [json.dumps({"text": t}) for t in TEXTS[:20]]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    docs = load_documents(f"hf:{folder}", streaming=True)
    assert [d.text for d in docs] == TEXTS[:20]
    assert load_documents(f"hf:{folder}") == docs  # the same ids without streaming


# ---- tokenizer.json -----------------------------------------------------------------------


def _train_tokenizer(path: Path, vocab_size: int = 300) -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers (the 'data' extra)")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 3, trainer)
    tok.save(str(path))


def test_tokenizer_json_round_trip_and_dataset(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    _train_tokenizer(path)
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer) and 256 < tok.vocab_size <= 300
    text = "the quick brown fox, record 12"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) and tok.decode(ids) == text
    assert tok.separator_ids == [tok.encode("<|endoftext|>")[0]]
    assert isinstance(load_tokenizer(""), ByteTokenizer)

    docs = [Document(f"d{i}", t) for i, t in enumerate(TEXTS)]
    ds = TextDataset(docs, tok, eval_fraction=0.2, shard=0, num_shards=1, seed=0, seq_len=16)
    assert ds.train_tokens.dtype == torch.int32
    assert int(ds.train_tokens.max()) < tok.vocab_size
    num_docs = len(ds.train_doc_ids)
    assert int((ds.train_tokens == tok.separator_ids[0]).sum()) == num_docs - 1
    ids_b, labels_b = ds.sample_batch(torch.Generator().manual_seed(0), 4, 16)
    assert ids_b.shape == (4, 16) and torch.equal(ids_b[:, 1:], labels_b[:, :-1])


def test_tokenizer_sets_model_vocab(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    _train_tokenizer(path)
    size = load_tokenizer(str(path)).vocab_size
    data = DataConfig(tokenizer=str(path))
    assert model_vocab_size(data, 256) == size  # raised to the tokenizer's
    assert model_vocab_size(data, 4096) == 4096  # a larger one is kept
    assert model_vocab_size(DataConfig(), 256) == 256
    config = with_tokenizer_vocab(resolve_config(overrides={"data.tokenizer": str(path)}))
    assert config.model.vocab_size == size
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    data = DataConfig(path=str(corpus), tokenizer=str(path), seq_len=16, eval_fraction=0.2)
    with pytest.raises(
        ValueError, match=f"tokenizer has {size} tokens but model.vocab_size is 256"
    ):
        open_dataset(data, shard=0, seed=0, vocab_size=256)
    ds = open_dataset(data, shard=0, seed=0, vocab_size=size)
    assert ds.vocab_size == size


def test_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer file not found"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(str(bad))


# ---- packing ------------------------------------------------------------------------------


def test_pack_rows() -> None:
    tokens = torch.arange(23)
    rows = pack(tokens, 5)
    assert rows.shape == (4, 6)  # (23 - 1) // 5 full rows; the 2-token tail is left out
    assert torch.equal(rows[0], torch.arange(6)) and torch.equal(rows[3], torch.arange(15, 21))
    labels = rows[:, 1:].reshape(-1)
    assert torch.equal(labels, torch.arange(1, 21))  # every token a label exactly once
    assert pack(torch.arange(5), 5).shape == (0, 6)
    with pytest.raises(ValueError, match="seq_len"):
        pack(tokens, 0)


def test_documents_packed_across_boundaries() -> None:
    docs = [Document(f"d{i}", f"<{i:02d}>" + "z" * 8) for i in range(30)]  # 12 bytes each
    ds = TextDataset(docs, ByteTokenizer(), eval_fraction=0.0, shard=0, num_shards=1, seed=3)
    # Documents are concatenated with a blank line between them, then cut at every 8 tokens:
    # sequences cross document boundaries and no token is padding.
    assert ds.num_train_tokens == 30 * 12 + 29 * 2
    ids, labels = ds.sample_batch(torch.Generator().manual_seed(1), 64, 8)
    flat = ds.train_tokens.long()
    for row_ids, row_labels in zip(ids, labels, strict=True):
        # Every sampled sequence is a packed row: it starts at a multiple of 8.
        assert any(
            torch.equal(flat[s : s + 8], row_ids) and torch.equal(flat[s + 1 : s + 9], row_labels)
            for s in range(0, flat.numel() - 8, 8)
        )
    text = ByteTokenizer().decode(flat.tolist())
    assert text.count("\n\n") == 29


# ---- shards -------------------------------------------------------------------------------


def test_shards_stable_as_heads_come_and_go() -> None:
    docs = [Document(f"doc-{i}", f"text {i}") for i in range(2000)]
    num_shards = 8
    heads = [f"{i:08x}{'ab' * 4}" for i in (0x1234, 0x9999, 0xDEAD, 0x4242)]
    shards = {h: shard_of(h, num_shards) for h in heads}
    assert len(set(shards.values())) == len(heads), "these ids hash to distinct shards"

    def train_ids(head: str, corpus: list[Document]) -> set[str]:
        train, _ = split_documents(corpus, eval_fraction=0.05, shard=shards[head], num_shards=8)
        return {d.doc_id for d in train}

    before = {h: train_ids(h, docs) for h in heads}
    # Disjoint between heads, and with every shard taken the train docs are complete.
    assert sum(map(len, before.values())) == len(set().union(*before.values()))
    every = [split_documents(docs, eval_fraction=0.05, shard=s, num_shards=8) for s in range(8)]
    assert sum(len(t) for t, _ in every) + len(every[0][1]) == len(docs)
    # A head leaves: the others keep exactly their documents (nothing depends on who is up).
    remaining = heads[1:]
    assert all(train_ids(h, docs) == before[h] for h in remaining)
    # A shard is a function of the peer id alone, the same in any process.
    assert shard_of(heads[0], num_shards) == int(heads[0][:8], 16) % num_shards
    # New documents join a shard without moving existing ones.
    grown = docs + [Document(f"new-{i}", "more") for i in range(100)]
    assert all(before[h] <= train_ids(h, grown) for h in heads)


# ---- errors before training ---------------------------------------------------------------


def test_open_dataset_errors(tmp_path: Path) -> None:
    def config(path: Path, **kw: object) -> DataConfig:
        return DataConfig(path=str(path), seq_len=32, **kw)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="corpus path not found"):
        open_dataset(config(tmp_path / "nope"), shard=0, seed=0, vocab_size=256)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfd")
    with pytest.raises(ValueError, match="not valid UTF-8"):
        open_dataset(config(bad), shard=0, seed=0, vocab_size=256)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"content": "x" * 500}) + "\n")
    with pytest.raises(ValueError, match="no string field 'text'"):
        open_dataset(config(rows), shard=0, seed=0, vocab_size=256)
    rows.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="empty"):
        open_dataset(config(rows), shard=0, seed=0, vocab_size=256)
    rows.write_text(json.dumps({"text": "tiny"}) + "\n")
    with pytest.raises(ValueError, match="train split has 4 tokens"):
        open_dataset(config(rows, eval_fraction=0.0, num_shards=1), shard=0, seed=0, vocab_size=256)
    with pytest.raises(ValueError, match="max_documents"):
        DataConfig(max_documents=-1)
