"""The ``series`` source: parquet shards of multichannel time series, streamed, never loaded
whole (``convoy data synth-telematics`` writes such a dataset; so can any pipeline)::

    <path>/train/*.parquet   <path>/val/*.parquet   <path>/test/*.parquet (optional: val)
    <path>/series.json       optional: {"channels": [...], "classes": [...]}

``data.path`` is a folder or ``s3://bucket/prefix``. Each row is one sample: one column per
channel (``data.series_columns``; default: series.json's channels, else every list column in
schema order) and an integer label (``data.label_column``). A channel is a list of numbers,
or packed: ``fixed_size_binary`` of little-endian float32 values (4 bytes a step), which
parquet stores without a list's repetition levels and reads several times faster
(``convoy data synth-telematics --layout packed``; ``benchmarks/stream_gpu.py``). Every
series must have one length, or ``data.series_len`` is the padding rule: shorter series are
padded with zeros at the end, longer ones cut. Channels are standardized with the mean and
standard deviation of the first ``STATS_ROWS`` training rows (a bounded read, the same in
every process).

Splits are ``ShardedSplit``s: the torch loader streams them row group by row group
(``convoy.data.streaming``), Ray Data reads row groups in its tasks (``convoy.data.ray_data``).
The checks before any worker starts read footers, the first row group of each split and the
label column: an empty shard, shards whose columns disagree, a channel that is not a list
column and series of different lengths without ``data.series_len`` are refused with one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from convoy.config import DataConfig
from convoy.data.base import Splits
from convoy.data.sensors import channel_stats
from convoy.data.shards import (
    ShardedSplit,
    join,
    list_shards,
    open_location,
    scan_splits,
)
from convoy.errors import ConfigError, DataError

SPLITS = ("train", "val", "test")
META_FILE = "series.json"
STATS_ROWS = 4096
EXPECTED = (
    "series reads <path>/train/*.parquet and <path>/val/*.parquet (a folder or s3://bucket/"
    "prefix), e.g. written by `convoy data synth-telematics <path> --devices 50 --hours 1`"
)


@dataclass(frozen=True)
class SeriesDecoder:
    """A row group (pyarrow table) -> (series (N, C, T) float32, labels (N,) int64)."""

    channels: tuple[str, ...]
    label_column: str
    length: int
    pad: bool
    """True when ``data.series_len`` is set: pad or cut every series to ``length``."""
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def __call__(self, table: Any, shard: str) -> tuple[torch.Tensor, torch.Tensor]:
        rows = table.num_rows
        series = np.zeros((rows, len(self.channels), self.length), dtype=np.float32)
        for c, name in enumerate(self.channels):
            series[:, c] = self._channel(table.column(name).combine_chunks(), name, shard)
        x = torch.from_numpy(series)
        if self.mean:  # in place: no copies of the whole row group
            x.sub_(torch.tensor(self.mean).view(1, -1, 1)).div_(
                torch.tensor(self.std).view(1, -1, 1)
            )
        labels = table.column(self.label_column)
        if labels.null_count:
            row = int(np.flatnonzero(labels.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(f"data.label_column: shard {shard} row {row} has no label (null)")
        return x, torch.from_numpy(labels.to_numpy(zero_copy_only=False).astype(np.int64))

    def _channel(self, column: Any, name: str, shard: str) -> np.ndarray:
        import pyarrow as pa  # 0.3 s to import: only where parquet is read
        import pyarrow.compute as pc

        if pa.types.is_fixed_size_list(column.type):  # one layout for the offsets below
            column = column.cast(pa.list_(column.type.value_type))
        if column.null_count:
            row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(
                f"data.series_columns: shard {shard} row {row} has no {name!r} series (null); "
                "every row needs every channel"
            )
        if pa.types.is_fixed_size_binary(column.type):
            return self._fitted(_packed_values(column), name, shard)
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        values = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
        if (lengths == self.length).all():
            return values.reshape(len(lengths), self.length)
        if not self.pad:
            row = int(np.flatnonzero(lengths != self.length)[0])
            raise self._unequal(shard, row, int(lengths[row]), name)
        out = np.zeros((len(lengths), self.length), dtype=np.float32)
        offsets = column.offsets.to_numpy()
        for row, start in enumerate(offsets[:-1]):
            kept = min(int(lengths[row]), self.length)
            out[row, :kept] = values[start - offsets[0] : start - offsets[0] + kept]
        return out

    def _fitted(self, values: np.ndarray, name: str, shard: str) -> np.ndarray:
        """Series of one length (packed: the column's) padded or cut to ``length``."""
        if values.shape[1] == self.length:
            return values
        if not self.pad:
            raise self._unequal(shard, 0, values.shape[1], name)
        out = np.zeros((len(values), self.length), dtype=np.float32)
        kept = min(values.shape[1], self.length)
        out[:, :kept] = values[:, :kept]
        return out

    def _unequal(self, shard: str, row: int, steps: int, name: str) -> DataError:
        return DataError(
            f"data.series_len: series of different lengths and no padding rule: shard "
            f"{shard} row {row} has {steps} steps in {name!r}, the first series "
            f"{self.length}; set data.series_len to pad (zeros at the end) or cut every "
            "series to one length"
        )


def _packed_values(column: Any) -> np.ndarray:
    """(rows, steps) float32 of a ``fixed_size_binary`` column of little-endian float32
    steps: a view of its data buffer, no decoding."""
    steps = column.type.byte_width // 4
    data = np.frombuffer(column.buffers()[1], dtype="<f4")
    return data[column.offset * steps : (column.offset + len(column)) * steps].reshape(-1, steps)


def check_series_path(path: str | None) -> None:
    if not path:
        raise ConfigError("data.path", path, EXPECTED)
    for split in ("train", "val"):
        if not list_shards(path, split):
            raise ConfigError("data.path", path, f"no parquet shards in {split}/; {EXPECTED}")


def _read_meta(location: str) -> dict[str, Any]:
    import pyarrow.fs as pafs  # 0.3 s to import: only where parquet is read

    fs, root = open_location(location)
    path = join(root, META_FILE)
    if fs.get_file_info(path).type != pafs.FileType.File:
        return {}
    with fs.open_input_stream(path) as stream:
        meta: dict[str, Any] = json.loads(stream.read().decode())
    return meta


def _channels(cfg: DataConfig, schema: Any, meta: dict[str, Any]) -> tuple[str, ...]:
    """The channel columns: configured, series.json's, else every list column; each must be a
    list of numbers."""
    import pyarrow as pa  # 0.3 s to import: only where parquet is read

    names = cfg.series_columns or meta.get("channels")
    if not names:
        names = [
            f.name for f in schema if pa.types.is_list(f.type) or pa.types.is_large_list(f.type)
        ]
    if not names:
        raise ConfigError("data.series_columns", None, f"no list columns in {cfg.path}; name them")
    for name in (*names, cfg.label_column):
        if name not in schema.names:
            field = "data.label_column" if name == cfg.label_column else "data.series_columns"
            raise ConfigError(field, name, f"not a column of {cfg.path}; it has {schema.names}")
    for name in names:
        kind = schema.field(name).type
        if pa.types.is_fixed_size_binary(kind):
            if kind.byte_width % 4:
                raise ConfigError(
                    "data.series_columns",
                    name,
                    f"is {kind}: a packed series is float32 steps, a multiple of 4 bytes",
                )
            continue
        if not (
            (
                pa.types.is_list(kind)
                or pa.types.is_large_list(kind)
                or pa.types.is_fixed_size_list(kind)
            )
            and (pa.types.is_floating(kind.value_type) or pa.types.is_integer(kind.value_type))
        ):
            raise ConfigError(
                "data.series_columns",
                name,
                f"is {kind}, not a list of numbers or packed float32 (fixed_size_binary; one "
                "series per row)",
            )
    if not pa.types.is_integer(schema.field(cfg.label_column).type):
        raise ConfigError(
            "data.label_column",
            cfg.label_column,
            f"is {schema.field(cfg.label_column).type}; series classification needs integer labels",
        )
    return tuple(names)


def _first_length(split: ShardedSplit, channel: str) -> int:
    import pyarrow as pa  # 0.3 s to import: only where parquet is read
    import pyarrow.compute as pc

    column = split.read_table(0, [channel]).column(channel)
    if pa.types.is_fixed_size_binary(column.type):
        return int(column.type.byte_width // 4)
    return int(pc.list_value_length(column)[0].as_py())


def load_series(cfg: DataConfig) -> Splits:
    """The three streamed splits (see the module docstring)."""
    if cfg.train_size is not None:  # before any read: nothing to cap in a stream
        raise ConfigError(
            "data.train_size", cfg.train_size, "series streams whole splits; remove it"
        )
    location = str(cfg.path)
    check_series_path(location)
    meta = _read_meta(location)
    scanned = scan_splits(location, SPLITS)
    schema = scanned["train"][1]
    channels = _channels(cfg, schema, meta)
    columns = [*channels, cfg.label_column]
    splits = {
        split: ShardedSplit(location, groups, columns, _no_decoder, cfg.label_column)
        for split, (groups, _) in scanned.items()
    }
    length = cfg.series_len or _first_length(splits["train"], channels[0])
    raw = SeriesDecoder(channels, cfg.label_column, length, cfg.series_len is not None)
    mean, std = channel_stats(_first_rows(splits["train"], raw, STATS_ROWS))
    decoder = replace(raw, mean=tuple(mean.flatten().tolist()), std=tuple(std.flatten().tolist()))
    for sharded in splits.values():
        sharded.decode = decoder
        sharded.read(0)  # the first row group of each split: lengths and labels decode
    classes = meta.get("classes") or _classes_from_labels(splits["train"])
    test = splits.get("test", splits["val"])
    shape = {"num_classes": len(classes), "in_channels": len(channels), "seq_len": length}
    info = {"classes": list(classes), "channels": list(channels), "streamed": True}
    return Splits(splits["train"], splits["val"], test, shape, meta=info)


def _no_decoder(table: Any, shard: str) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError("the decoder is set once the channels are known")


def _first_rows(split: ShardedSplit, decoder: SeriesDecoder, rows: int) -> torch.Tensor:
    parts, count = [], 0
    for position in range(len(split.groups)):
        x, _ = decoder(split.read_table(position), split.groups[position].shard)
        parts.append(x)
        count += len(x)
        if count >= rows:
            break
    return torch.cat(parts)[:rows]


def _classes_from_labels(train: ShardedSplit) -> list[str]:
    labels = train.targets_head(1_000_000)
    return [str(i) for i in range(int(labels.max()) + 1)]
