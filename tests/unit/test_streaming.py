"""Streamed splits (parquet row groups) through the torch loader: each row at most once per
epoch over all ranks, an exact mid-epoch resume, every eval row once; and the ``series``
source's checks, one line each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from convoy.config import DataConfig
from convoy.data.registry import check_dataset, load_splits
from convoy.data.shards import ShardedSplit, list_shards, scan_shards
from convoy.data.streaming import StreamedEvalBatches, StreamedTrainBatches, rebatch
from convoy.data.telematics import FleetSpec, write_fleet
from convoy.errors import ConfigError, ConvoyError, DataError


def row_ids(table: Any, shard: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(table.column("id").to_numpy())
    return ids, ids % 3


def id_split(tmp_path: Path, sizes: list[list[int]]) -> ShardedSplit:
    """Shards of row groups of the given sizes; row ids count up from 0."""
    next_id = 0
    for s, groups in enumerate(sizes):
        path = tmp_path / "train" / f"part-{s:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        schema = pa.schema([("id", pa.int64())])
        with pq.ParquetWriter(path, schema) as writer:
            for rows in groups:
                ids = np.arange(next_id, next_id + rows)
                writer.write_table(pa.table({"id": ids}, schema=schema))
                next_id += rows
    groups, _ = scan_shards(str(tmp_path), list_shards(str(tmp_path), "train"))
    return ShardedSplit(str(tmp_path), groups, ["id"], row_ids, "id")


SIZES = [[7, 5, 9], [6], [8, 3, 11]]  # 49 rows in 7 row groups of odd sizes


def epoch_rows(
    split: ShardedSplit, epoch: int, world: int, skip: int = 0, readers: int = 2
) -> list[list[int]]:
    ranks = []
    for rank in range(world):
        batches = StreamedTrainBatches(split, 8, 2, world, rank, seed=3, window=2, readers=readers)
        batches.start_epoch(epoch, skip)
        rows = [int(i) for x, _ in batches for i in x]
        assert len(rows) == len(batches) * 2 - skip * (8 // world)
        ranks.append(rows)
    return ranks


@pytest.mark.parametrize("world", [1, 2])
def test_every_row_at_most_once_per_epoch_and_a_new_order_each_epoch(
    tmp_path: Path, world: int
) -> None:
    split = id_split(tmp_path, SIZES)
    epochs = [epoch_rows(split, epoch, world) for epoch in range(3)]
    for ranks in epochs:
        seen = [row for rows in ranks for row in rows]
        assert len(seen) == len(set(seen))  # once at most
        per_rank = len(ranks[0])
        assert all(len(rows) == per_rank for rows in ranks)  # the same steps on every rank
        assert per_rank % (8 // world) == 0  # whole shares of global batches of 8
        assert len(seen) >= 49 - 8 * world - 11  # only a rank's tail of < 1 step is left
        assert set(seen) <= set(range(49))
    assert epochs[0] != epochs[1] != epochs[2]


def test_a_resumed_epoch_continues_with_the_rows_not_yet_trained(tmp_path: Path) -> None:
    split = id_split(tmp_path, SIZES)
    for world in (1, 2):
        whole = epoch_rows(split, epoch=1, world=world)
        share = 8 // world
        for skip in (1, 2, 3):
            resumed = epoch_rows(split, epoch=1, world=world, skip=skip)
            assert resumed == [rows[skip * share :] for rows in whole]
        for readers in (1, 3):  # windows read at once: the same rows in the same order
            assert epoch_rows(split, epoch=1, world=world, readers=readers) == whole


def test_an_epoch_is_read_from_start_epoch_on_with_the_same_rows(tmp_path: Path) -> None:
    """start_epoch reads the first window before any batch is asked for (the engine starts
    the next epoch before evaluating the last); a second start_epoch of the same epoch keeps
    that reading, and the rows are those of an epoch started as it is iterated."""
    split = id_split(tmp_path, SIZES)
    expected = epoch_rows(split, epoch=2, world=1)[0]
    reads: list[int] = []
    reading = ShardedSplit(
        split.location,
        split.groups,
        split.columns,
        lambda table, shard: reads.append(len(table)) or row_ids(table, shard),
        "id",
    )
    batches = StreamedTrainBatches(reading, 8, 2, 1, 0, seed=3, window=2, readers=1)
    list(batches)  # epoch 0, as the engine trains it
    reads.clear()
    batches.start_epoch(2)
    assert batches.started is not None
    batches.started.first.result()  # read without a batch asked for
    first_window = [batches.rows[p] for p in batches.windows(2)[0]]
    assert reads[:2] == first_window
    batches.start_epoch(2)  # again, right before iterating: the same reading goes on
    assert [int(i) for x, _ in batches for i in x] == expected
    assert sorted(reads) == sorted(batches.rows)  # every group read once, none twice


@pytest.mark.parametrize("size", [1, 3, 4, 10, 40])
def test_rebatch_cuts_any_chunks_into_the_same_rows_in_order(size: int) -> None:
    lengths = [5, 0, 3, 12, 1, 1, 7]  # 29 rows
    chunks, first = [], 0
    for length in lengths:
        rows = torch.arange(first, first + length)
        chunks.append((rows, -rows))
        first += length
    for keep_last in (False, True):
        batches = list(rebatch(iter(chunks), size, keep_last))
        whole = 29 // size * size
        assert [len(x) for x, _ in batches] == [size] * (29 // size) + (
            [29 - whole] if keep_last and whole < 29 else []
        )
        rows = torch.cat([x for x, _ in batches]) if batches else torch.empty(0)
        assert rows.tolist() == list(range(len(rows)))
        assert all(torch.equal(y, -x) for x, y in batches)


def test_every_eval_row_once_over_ranks_with_masked_padding(tmp_path: Path) -> None:
    split = id_split(tmp_path, SIZES)
    for world in (1, 2, 3, 4):
        seen, counts = [], []
        for rank in range(world):
            batches = StreamedEvalBatches(split, 4, world, rank)
            rows = [int(i) for x, _ in batches for i in x]
            counts.append(sum(1 for _ in batches))
            seen += rows[: batches.num_real]
        assert sorted(seen) == list(range(49))
        assert len(set(counts)) == 1  # every rank runs the same number of batches


def fleet(tmp_path: Path, **kwargs: Any) -> Path:
    out = tmp_path / "fleet"
    spec = {"devices": 5, "hours": 0.05, "rate_hz": 5, "rows_per_group": 4, **kwargs}
    write_fleet(FleetSpec(**spec), str(out))
    return out


def test_the_series_source_streams_the_generated_fleet(tmp_path: Path) -> None:
    path = fleet(tmp_path)
    splits = load_splits(DataConfig(name="series", path=str(path)))
    assert splits.shape == {"num_classes": 5, "in_channels": 6, "seq_len": 50}
    assert (len(splits.train), len(splits.val), len(splits.test)) == (54, 18, 18)
    x, y = splits.train[53]
    assert x.shape == (6, 50) and x.dtype == torch.float32 and 0 <= int(y) < 5
    # Standardized with the first training rows' statistics: about zero mean, unit std.
    first = torch.stack([splits.train[i][0] for i in range(54)])
    assert first.mean(dim=(0, 2)).abs().max() < 0.05
    assert (first.std(dim=(0, 2)) - 1).abs().max() < 0.05
    again = load_splits(DataConfig(name="series", path=str(path)))
    assert torch.equal(again.test[7][0], splits.test[7][0])  # seeded: the same rows


def test_a_split_reads_the_same_after_pickling_and_from_another_thread(tmp_path: Path) -> None:
    """Open shards are kept per thread and never pickled: a Ray task or a reading thread
    opens its own, and reads what the first reader read."""
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    split = id_split(tmp_path, SIZES)
    first = [split.read(p)[0].tolist() for p in range(len(split.groups))]
    copy = pickle.loads(pickle.dumps(split))
    assert [copy.read(p)[0].tolist() for p in range(len(split.groups))] == first
    with ThreadPoolExecutor(1) as other:
        assert other.submit(lambda: split.read(6)[0].tolist()).result() == first[6]
    assert [i for group in first for i in group] == list(range(49))


def test_packed_series_read_as_the_same_numbers_as_lists(tmp_path: Path) -> None:
    """``--layout packed`` (fixed_size_binary float32) streams the same tensors as lists; a
    packed column of another length is padded by data.series_len or refused in one line."""
    lists = load_splits(DataConfig(name="series", path=str(fleet(tmp_path / "l"))))
    path = fleet(tmp_path / "p", layout="packed")
    assert pa.types.is_fixed_size_binary(
        pq.read_schema(path / "train" / "part-00000.parquet").field("accel_x").type
    )
    packed = load_splits(DataConfig(name="series", path=str(path)))
    assert packed.shape == lists.shape
    for split in ("train", "val", "test"):
        a, b = getattr(lists, split), getattr(packed, split)
        for position in range(len(a.groups)):
            (xa, ya), (xb, yb) = a.read(position), b.read(position)
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    for length in (60, 40):  # padded, cut
        cfg = DataConfig(name="series", path=str(path), series_len=length)
        fitted = load_splits(cfg).train[7][0]
        assert fitted.shape == (6, length)
        assert torch.equal(
            fitted,
            load_splits(cfg.model_copy(update={"path": str(tmp_path / "l/fleet")})).train[7][0],
        )
    for shard in path.glob("*/*.parquet"):
        rows = pq.read_metadata(shard).num_rows
        odd = pa.array([b"\0" * 6] * rows, pa.binary(6))
        rewrite(shard, lambda t: t.set_column(t.column_names.index("gyro_x"), "gyro_x", odd))  # noqa: B023
    with pytest.raises(
        ConfigError, match=r"data.series_columns: got 'gyro_x'.*multiple of 4 bytes"
    ):
        load_splits(DataConfig(name="series", path=str(path)))
    # A channel packed shorter than the others (40 steps against 50): a padding rule or a refusal.
    for shard in path.glob("*/*.parquet"):
        rows = pq.read_metadata(shard).num_rows
        short = pa.array([b"\0" * 160] * rows, pa.binary(160))
        rewrite(shard, lambda t: t.set_column(t.column_names.index("gyro_x"), "gyro_x", short))  # noqa: B023
    with pytest.raises(DataError, match=r"data.series_len: .* has 40 steps in 'gyro_x'"):
        load_splits(DataConfig(name="series", path=str(path)))
    assert load_splits(DataConfig(name="series", path=str(path), series_len=50)).train[0][
        0
    ].shape == (6, 50)


def rewrite(shard: Path, change: Any) -> None:
    pq.write_table(change(pq.read_table(shard)), shard)


def test_bad_series_data_is_refused_with_one_line(tmp_path: Path) -> None:
    path = fleet(tmp_path)
    shard = path / "train" / "part-00000.parquet"
    cfg = DataConfig(name="series", path=str(path))
    empty = path / "train" / "part-00009.parquet"
    pq.write_table(pq.read_table(shard).slice(0, 0), empty)
    with pytest.raises(ConfigError, match=r"data.path: .*shard .*part-00009.parquet holds no rows"):
        load_splits(cfg)
    empty.unlink()

    renamed = path / "train" / "part-00001.parquet"
    pq.write_table(pq.read_table(shard).rename_columns(
        [c if c != "gyro_z" else "yaw" for c in pq.read_table(shard).column_names]
    ), renamed)  # fmt: skip
    with pytest.raises(ConfigError, match=r"part-00001.parquet has no column 'gyro_z'"):
        load_splits(cfg)
    renamed.unlink()

    original = pq.read_table(shard)

    def shorter_row_3(table: Any) -> Any:
        values = table.column("accel_y").to_pylist()
        values[3] = values[3][:40]
        column = table.schema.field("accel_y")
        return table.set_column(
            table.column_names.index("accel_y"), column, pa.array(values, type=column.type)
        )

    rewrite(shard, shorter_row_3)
    with pytest.raises(DataError, match=r"data.series_len: .*part-00000.parquet row 3 has 40"):
        load_splits(cfg)
    padded = load_splits(DataConfig(name="series", path=str(path), series_len=50))
    assert torch.equal(padded.train[3][0][1, 40:], torch.full((10,), padded.train[3][0][1, 40]))
    pq.write_table(original, shard)

    with pytest.raises(ConfigError, match=r"data.label_column: got 'kind'; not a column"):
        load_splits(DataConfig(name="series", path=str(path), label_column="kind"))
    with pytest.raises(ConfigError, match=r"data.series_columns: got 'device'; is string"):
        load_splits(DataConfig(name="series", path=str(path), series_columns=["device"]))
    with pytest.raises(ConfigError, match=r"data.path: .*no parquet shards in train/"):
        check_dataset(DataConfig(name="series", path=str(tmp_path)))


def test_a_text_column_that_is_not_text_is_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), corpus)
    with pytest.raises(ConfigError, match=r"data.text_column: got 'text'; .* int64, not text"):
        load_splits(DataConfig(name="text", path=str(corpus), tokenizer="bytes"))


def test_an_s3_path_that_cannot_be_reached_says_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    with pytest.raises(ConfigError) as refused:
        check_dataset(DataConfig(name="series", path="s3://fleet-bucket/telematics"))
    message = str(refused.value)
    assert message.startswith("data.path: got 's3://fleet-bucket/telematics'; cannot ")
    assert "http://127.0.0.1:9 with AWS_ACCESS_KEY_ID not set" in message
    assert "\n" not in message


def test_a_streamed_source_refuses_dataloader_processes(tmp_path: Path) -> None:
    from convoy.config import load_job
    from convoy.preflight import preflight

    path = fleet(tmp_path)
    job = load_job(
        None,
        ["data.name=series", f"data.path={path}", "model.name=conv1d", "data.num_workers=2"],
    )
    with pytest.raises(ConfigError, match=r"data.num_workers: got 2; .* leave it 0"):
        preflight(job)


def test_other_bad_shards_are_one_line_too(tmp_path: Path) -> None:
    path = fleet(tmp_path)
    shard = path / "train" / "part-00000.parquet"
    cfg = DataConfig(name="series", path=str(path))
    original = pq.read_table(shard)
    reordered = path / "train" / "part-00001.parquet"
    pq.write_table(original.select(list(reversed(original.column_names))), reordered)
    with pytest.raises(ConfigError, match=r"part-00001.parquet has the columns .* another order"):
        load_splits(cfg)
    reordered.write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match=r"data.path: .*cannot read shard .*part-00001.parquet"):
        load_splits(cfg)
    reordered.unlink()

    labels = original.column("label").to_pylist()
    labels[2] = None
    nulls = original.set_column(2, "label", pa.array(labels, pa.int64()))
    pq.write_table(nulls, shard)
    with pytest.raises(DataError, match=r"data.label_column: shard .*part-00000.parquet row 2"):
        load_splits(cfg)
    pq.write_table(original, shard)

    fixed = original.set_column(
        3, "accel_x", original.column("accel_x").cast(pa.list_(pa.float32(), 50))
    )
    for name in ("train", "val", "test"):
        for part in (path / name).glob("*.parquet"):
            table = pq.read_table(part)
            pq.write_table(table.set_column(3, "accel_x", table.column("accel_x").cast(fixed.schema.field("accel_x").type)), part)  # fmt: skip
    cut = load_splits(DataConfig(name="series", path=str(path), series_len=30))
    assert cut.train[0][0].shape == (6, 30)
    with pytest.raises(ConvoyError, match=r"already holds a dataset"):
        write_fleet(FleetSpec(devices=3, hours=0.05, rate_hz=5), str(path))
