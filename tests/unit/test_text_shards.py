"""The ``text`` source streamed from parquet shards: the in-memory packing rule on eval
splits, every token a target once in training, the counting cache, and bad input."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from convoy.config import DataConfig
from convoy.data import text_shards
from convoy.data.registry import check_dataset, load_splits
from convoy.data.streaming import StreamedEvalBatches, StreamedTrainBatches
from convoy.data.text import IGNORE_INDEX, PackedSequences, gzip_bits_per_byte
from convoy.errors import ConfigError
from task_data_helpers import write_text_shards


def pydoc_docs() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Any]]]:
    """Pydoc topics as train / val / test shards, with rows a stream must skip."""
    docs = pydoc_docs()
    splits: dict[str, list[Any]] = {
        "test": docs[:9],
        "val": [*docs[9:14], None, "   \n", *docs[14:17]],
        "train": docs[17:],
    }
    return write_text_shards(tmp_path_factory.mktemp("corpus"), splits, rows_per_group=2), splits


def cfg(path: Path | str, **kwargs: Any) -> DataConfig:
    return DataConfig(name="text", path=str(path), seq_len=kwargs.pop("seq_len", 64), **kwargs)


def kept(docs: list[Any]) -> list[str]:
    return [d for d in docs if d and d.strip()]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_eval_splits_pack_as_in_memory_across_row_groups_and_shards(
    corpus: tuple[Path, dict[str, list[Any]]], tokenizer: str
) -> None:
    root, docs = corpus
    splits = load_splits(cfg(root, tokenizer=tokenizer, vocab_size=300))
    for name, split in (("val", splits.val), ("test", splits.test)):
        stream = split.tokenizer.encode(kept(docs[name]))
        expected = PackedSequences(stream, 64)
        assert len(split) == len(expected) and len(split.groups) > 4, name
        for i in range(len(split)):
            assert all(torch.equal(a, b) for a, b in zip(split[i], expected[i], strict=True))
        text = "\n".join(kept(docs[name])).encode()
        metric = splits.meta["reference_metrics"][f"{name}/gzip_bpb"]
        assert metric == pytest.approx(gzip_bits_per_byte(text), rel=1e-12)
    assert splits.shape == {"vocab_size": 256 if tokenizer == "bytes" else 300, "seq_len": 64}


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_training_makes_every_document_token_a_target_once(
    corpus: tuple[Path, dict[str, list[Any]]], tokenizer: str
) -> None:
    """Each row group packs its own stream; every target of the whole stream is in one of
    them, except the separators that join one row group to the next."""
    root, docs = corpus
    train = load_splits(cfg(root, tokenizer=tokenizer, vocab_size=300)).train
    stream = train.tokenizer.encode(docs["train"]).long()
    targets = []
    for position, group in enumerate(train.groups):
        x, y = train.read(position)
        assert x.shape == y.shape == (group.rows, 64)
        targets.append(y[y != IGNORE_INDEX])
    joins = torch.tensor(train.offsets[1:-1])  # where each group after the first starts
    assert torch.equal(stream[joins], torch.full_like(joins, train.tokenizer.newline))
    kept_targets = torch.ones(len(stream), dtype=torch.bool)
    kept_targets[0] = kept_targets[joins] = False
    assert torch.equal(torch.cat(targets), stream[kept_targets])


def test_the_torch_loader_streams_each_sequence_once_and_evaluates_each_once(
    corpus: tuple[Path, dict[str, list[Any]]],
) -> None:
    splits = load_splits(cfg(corpus[0], tokenizer="bytes"))
    seen = []
    for rank in range(2):
        batches = StreamedTrainBatches(splits.train, 8, 4, 2, rank, seed=3, window=2)
        batches.start_epoch(1)
        seen += [row for x, _ in batches for row in map(tuple, x.tolist())]
    every = Counter(
        row
        for p in range(len(splits.train.groups))
        for row in map(tuple, splits.train.read(p)[0].tolist())
    )
    assert len(seen) == 2 * len(batches) * 4 > 0.9 * len(splits.train)
    assert not Counter(seen) - every  # no sequence more often than the split holds it
    evaluated = [
        row
        for rank in range(3)
        for x, y in StreamedEvalBatches(splits.val, 5, 3, rank)._real_batches()
        for row in map(tuple, y.tolist())
    ]
    assert evaluated == [tuple(splits.val[i][1].tolist()) for i in range(len(splits.val))]


def test_counts_are_cached_per_content(
    corpus: tuple[Path, dict[str, list[Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, docs = corpus
    monkeypatch.setenv("CONVOY_CACHE_DIR", str(tmp_path / "cache"))
    first = load_splits(cfg(root, tokenizer="bytes"))
    counted = []
    real = text_shards.count_split
    monkeypatch.setattr(
        text_shards,
        "count_split",
        lambda *a: counted.append(1) or real(*a),  # type: ignore[func-returns-value]
    )
    again = load_splits(cfg(root, tokenizer="bytes"))
    assert counted == [] and len(again.train) == len(first.train)
    changed = write_text_shards(tmp_path / "changed", {**docs, "val": docs["val"][:4]})
    assert len(load_splits(cfg(changed, tokenizer="bytes")).val) < len(first.val)
    assert len(counted) == 3  # a new corpus is counted: train, val, test


def refused(match: str, data: DataConfig, check: bool = False) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        check_dataset(data) if check else load_splits(data)
    assert "\n" not in str(caught.value)


def test_bad_corpora_are_refused_in_one_line(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    missing_val = write_text_shards(tmp_path / "a", {"train": ["a b c"] * 4})
    refused(r"no parquet shards in val/", cfg(missing_val), check=True)
    numbers = tmp_path / "b"
    for split in ("train", "val"):
        (numbers / split).mkdir(parents=True)
        pq.write_table(pa.table({"text": [1, 2, 3]}), numbers / split / "part.parquet")
    refused(r"data.text_column.*is int64, not text", cfg(numbers))
    refused(r"data.text_column.*no such column; it has text", cfg(numbers, text_column="body"))
    refused(r"data.train_size.*streamed corpus", cfg(numbers, train_size=4))
    blank = write_text_shards(tmp_path / "c", {"train": ["one two"] * 3, "val": ["  "] * 3})
    refused(r"the val split has fewer than 2 tokens", cfg(blank, tokenizer="bytes"))


def test_both_loaders_deal_the_same_units_when_a_row_group_packs_nothing(tmp_path: Path) -> None:
    """A row group of blank documents holds no sequence: neither loader makes it a unit, so
    the torch loader and Ray Data deal the same row groups."""
    from convoy.data.ray_data import row_group_slices

    docs = pydoc_docs()
    train: list[Any] = [*docs[10:14], "  ", None, *docs[14:40]]  # the 3rd group is blank
    root = write_text_shards(tmp_path, {"train": train, "val": docs[:5]}, rows_per_group=2)
    split = load_splits(cfg(root, tokenizer="bytes")).train
    assert [g.rows for g in split.groups].count(0) == 1
    streamed = StreamedTrainBatches(split, 8, 4, 2, 0, seed=3, window=2)
    ray_units = [item["position"] for item in row_group_slices(split, range(len(split)))]
    assert streamed.positions == ray_units and 2 not in ray_units
