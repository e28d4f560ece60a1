"""The ``text`` source: reading, splitting, tokenizing, packing, and what meta records."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from convoy.config import DataConfig
from convoy.data.registry import check_dataset, load_splits
from convoy.data.text import (
    IGNORE_INDEX,
    PAD_ID,
    PackedSequences,
    chunk_text,
    gzip_bits_per_byte,
    read_documents,
    split_documents,
)
from convoy.data.tokenizer import BPETokenizer
from convoy.errors import ConfigError, ConvoyError, DataError

# Sentences with multi-byte characters, so byte counts differ from character counts.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog. ",
    "Grüße aus Köln, où l'été est très chaud! ",
    "Ранний снег и тёплый чай. ",
    "東京は雨です。 ",
    "Pack my box with five dozen liquor jugs; numbers 12345 and symbols €%&. ",
]


def make_doc(i: int, sentences: int = 12) -> str:
    return "".join(SENTENCES[(i + k) % len(SENTENCES)] for k in range(sentences)) + f"doc {i}"


def text_cfg(path: Path | str | None = None, **kwargs: Any) -> DataConfig:
    return DataConfig(name="text", path=None if path is None else str(path), **kwargs)


# --- packing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n_tokens", [2, 17, 33, 64, 65])
def test_packing_makes_every_token_after_the_first_a_target_once(n_tokens: int) -> None:
    seq_len = 16
    tokens = torch.arange(1, n_tokens + 1, dtype=torch.int32)  # no 0, so padding shows
    data = PackedSequences(tokens, seq_len)
    assert len(data) == -(-(n_tokens - 1) // seq_len)
    targets, inputs = [], []
    for i in range(len(data)):
        x, y = data[i]
        assert x.shape == y.shape == (seq_len,)
        assert x.dtype == y.dtype == torch.long
        real = y != IGNORE_INDEX
        # Targets are the inputs shifted by one; padding is masked and pads inputs with 0.
        assert torch.equal(y[real], x[real] + 1)
        assert (x[~real] == PAD_ID).all()
        assert real[: int(real.sum())].all()  # padding only at the tail
        targets += y[real].tolist()
        inputs += x[real].tolist()
    assert targets == list(range(2, n_tokens + 1))
    assert inputs == list(range(1, n_tokens))
    with pytest.raises(IndexError):
        data[len(data)]


def test_default_corpus_sequences_respect_seq_len() -> None:
    splits = load_splits(text_cfg(seq_len=32, tokenizer="bytes"))
    assert splits.shape == {"vocab_size": 256, "seq_len": 32}
    x, y = splits.val[len(splits.val) - 1]
    assert x.shape == y.shape == (32,)
    inner = y[1:] != IGNORE_INDEX  # both positions real: input t+1 is target t
    assert inner.any() and torch.equal(x[1:][inner], y[:-1][inner])


# --- tokenizers -------------------------------------------------------------------------------


def stream_digest(cfg: DataConfig) -> str:
    splits = load_splits(cfg)
    digest = hashlib.sha256()
    for split in (splits.train, splits.val, splits.test):
        digest.update(split.tokens.numpy().tobytes())  # type: ignore[attr-defined]
    return digest.hexdigest()


def test_bpe_is_deterministic_across_loads_and_processes() -> None:
    cfg = text_cfg(vocab_size=1024)
    here = stream_digest(cfg)
    assert stream_digest(cfg) == here
    # Another process with another thread count and hash seed: what another rank would build.
    script = (
        "from tests.unit.test_text_data import stream_digest, text_cfg;"
        "print(stream_digest(text_cfg(vocab_size=1024)))"
    )
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONHASHSEED": "123"}
    root = Path(__file__).parents[2]
    other = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True
    )
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == here


def test_bpe_vocabulary_and_token_bytes_cover_the_split_text_exactly() -> None:
    cfg = text_cfg(vocab_size=1024)
    splits = load_splits(cfg)
    assert splits.shape == {"vocab_size": 1024, "seq_len": 128}
    token_bytes = splits.meta["token_bytes"]
    assert len(token_bytes) == 1024 and min(token_bytes) >= 1
    test_docs, val_docs, _ = split_documents(
        read_documents(cfg), cfg.test_fraction, cfg.val_fraction
    )
    for docs, split in ((val_docs, splits.val), (test_docs, splits.test)):
        text = "\n".join(docs).encode("utf-8")
        tokens = split.tokens.tolist()  # type: ignore[attr-defined]
        # Every target token's bytes add up to the split's bytes (less the first token's).
        targets = [y for i in range(len(split)) for y in split[i][1].tolist() if y != IGNORE_INDEX]
        assert targets == tokens[1:]
        assert sum(token_bytes[t] for t in targets) == len(text) - token_bytes[tokens[0]]


def test_bpe_tokens_decode_to_the_exact_bytes() -> None:
    docs = [make_doc(i) for i in range(20)]
    tokenizer = BPETokenizer(docs, vocab_size=300)
    stream = tokenizer.encode(docs[:3]).tolist()
    assert b"".join(tokenizer.token_strings[t] for t in stream) == "\n".join(docs[:3]).encode()
    assert tokenizer.token_bytes == [len(s) for s in tokenizer.token_strings]


def test_bytes_tokenizer_uses_utf8_bytes(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"{i}.txt").write_text(make_doc(i), encoding="utf-8")
    cfg = text_cfg(tmp_path, tokenizer="bytes", seq_len=8)
    splits = load_splits(cfg)
    assert splits.shape["vocab_size"] == 256
    assert splits.meta["token_bytes"] == [1] * 256
    test_docs, val_docs, train_docs = split_documents(
        read_documents(cfg), cfg.test_fraction, cfg.val_fraction
    )
    splits_docs = ((train_docs, splits.train), (val_docs, splits.val), (test_docs, splits.test))
    for docs, split in splits_docs:
        assert bytes(split.tokens.tolist()) == "\n".join(docs).encode()  # type: ignore[attr-defined]


def test_missing_tokenizers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
    with pytest.raises(ConvoyError, match=r"pip install 'convoy\[text\]'"):
        load_splits(text_cfg())
    assert load_splits(text_cfg(tokenizer="bytes")).shape["vocab_size"] == 256


# --- splitting and reference metrics ----------------------------------------------------------


def test_default_corpus_splits_by_characters_and_records_gzip() -> None:
    cfg = text_cfg()
    docs = read_documents(cfg)
    test_docs, val_docs, train_docs = split_documents(docs, 0.2, 0.1)
    assert sorted(test_docs + val_docs + train_docs) == sorted(docs)
    total = sum(map(len, docs))
    assert abs(sum(map(len, test_docs)) / total - 0.2) < 0.05
    assert abs(sum(map(len, val_docs)) / total - 0.1) < 0.05
    reference = load_splits(cfg).meta["reference_metrics"]
    assert reference == {
        "val/gzip_bpb": gzip_bits_per_byte("\n".join(val_docs).encode()),
        "test/gzip_bpb": gzip_bits_per_byte("\n".join(test_docs).encode()),
    }
    assert 1.5 < reference["val/gzip_bpb"] < 4


def test_every_split_gets_a_document_or_a_clear_error(tmp_path: Path) -> None:
    test_docs, val_docs, train_docs = split_documents(["a", "b", "c"], 0.01, 0.01)
    assert len(test_docs) == len(val_docs) == len(train_docs) == 1
    (tmp_path / "a.txt").write_text("one short paragraph")
    (tmp_path / "b.txt").write_text("another")
    with pytest.raises(ConfigError, match="2 document") as err:
        load_splits(text_cfg(tmp_path))
    assert err.value.field == "data.path"


# --- reading ----------------------------------------------------------------------------------


def test_txt_folder_is_read_recursively_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b" / "deep").mkdir(parents=True)
    (tmp_path / "b" / "deep" / "z.txt").write_text(make_doc(2))
    (tmp_path / "b" / "a.txt").write_text(make_doc(1))
    (tmp_path / "a.txt").write_text(make_doc(0))
    (tmp_path / "notes.md").write_text("ignored")
    (tmp_path / ".hidden.txt").write_text("ignored")
    (tmp_path / "blank.txt").write_text("  \n")
    cfg = text_cfg(tmp_path, tokenizer="bytes")
    check_dataset(cfg)
    assert read_documents(cfg) == [make_doc(0), make_doc(1), make_doc(2)]
    splits = load_splits(cfg)
    assert min(len(splits.train), len(splits.val), len(splits.test)) >= 1


def test_single_txt_file_is_cut_into_chunks_at_blank_lines(tmp_path: Path) -> None:
    paragraphs = [make_doc(i, sentences=4) for i in range(200)]
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(paragraphs))
    docs = read_documents(text_cfg(path))
    assert len(docs) >= 8
    assert all(len(d) <= 4000 for d in docs) and all(len(d) >= 2000 for d in docs[:-1])
    assert [p for d in docs for p in d.split("\n\n")] == paragraphs
    assert chunk_text("x" * 9000) == ["x" * 4000, "x" * 4000, "x" * 1000]


def write_parquet(path: Path, rows: list[str | None], column: str = "body") -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: rows, "id": list(range(len(rows)))}), path)


def test_parquet_column_file_and_folder(tmp_path: Path) -> None:
    docs = [make_doc(i) for i in range(6)]
    write_parquet(tmp_path / "all.parquet", [*docs[:3], None, "", *docs[3:]])
    cfg = text_cfg(tmp_path / "all.parquet", text_column="body", tokenizer="bytes")
    assert read_documents(cfg) == docs
    folder = tmp_path / "shards"
    folder.mkdir()
    write_parquet(folder / "part-1.parquet", docs[3:])
    write_parquet(folder / "part-0.parquet", docs[:3])
    splits = load_splits(text_cfg(folder, text_column="body", vocab_size=300))
    assert read_documents(text_cfg(folder, text_column="body")) == docs
    assert splits.shape["vocab_size"] <= 300
    with pytest.raises(ConfigError, match="body, id") as err:
        load_splits(text_cfg(folder, text_column="text"))
    assert err.value.field == "data.text_column"


@pytest.mark.parametrize("layout", ["missing", "empty-folder", "other-files", "blank", "csv"])
def test_empty_or_missing_corpus_is_a_one_line_path_error(tmp_path: Path, layout: str) -> None:
    path = tmp_path / "corpus"
    if layout != "missing":
        path.mkdir()
    if layout == "other-files":
        (path / "readme.md").write_text("not a .txt file")
    if layout == "blank":
        (path / "a.txt").write_text("\n\n   \n")
        (path / "b.txt").write_text("")
    if layout == "csv":
        path = tmp_path / "corpus.csv"
        path.write_text("text\nhello\n")
    cfg = text_cfg(path)
    with pytest.raises(ConfigError) as err:
        check_dataset(cfg)
        load_splits(cfg)
    assert err.value.field == "data.path"
    assert "\n" not in str(err.value)


def test_undecodable_txt_file_is_named(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(make_doc(i))
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt is not UTF-8"):
        load_splits(text_cfg(tmp_path))


def test_train_size_caps_training_sequences() -> None:
    full = load_splits(text_cfg(tokenizer="bytes"))
    capped = load_splits(text_cfg(tokenizer="bytes", train_size=10))
    assert len(capped.train) == 10
    assert torch.equal(capped.train[9][1], full.train[9][1])
    assert len(capped.val) == len(full.val)
