"""Parquet splits read one row group at a time, from a folder or ``s3://bucket/prefix``.

A split is the sorted ``*.parquet`` files of one folder. Only their footers are read up front
(rows, row groups, schema): nothing about a split grows a worker's memory with its size. A
row group is the unit of reading, shuffling and sharding (``convoy.data.streaming`` for the
torch loader, ``convoy.data.ray_data`` for Ray Data); ``ShardedSplit`` also answers
``split[i]`` (reading, and keeping, the row group that holds row ``i``) so the checks and a
single-process evaluation can treat it as any dataset.

``s3://`` goes through pyarrow's S3 file system configured as the run's storage is (AWS
credentials and region the standard way, ``AWS_ENDPOINT_URL`` for an S3-compatible server):
the same settings serve checkpoints and data.

Imports no torch (its decoders do): a Ray Data task that reads an encoded image shard's row
groups unpickles a split and decodes the rows with Pillow and numpy alone.
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convoy.errors import ConfigError
from convoy.storage import is_remote

if TYPE_CHECKING:
    import torch

OPEN_SHARDS = 4
"""Shards a reading thread keeps open: a window's row groups come from a few shards."""

Decode = Callable[[Any, str], "tuple[torch.Tensor, torch.Tensor]"]
"""(a pyarrow table of one row group, its shard's name) -> (inputs, targets)."""


@functools.lru_cache(maxsize=8)
def open_location(location: str) -> tuple[Any, str]:
    """(pyarrow file system, path in it) of a local folder or an ``s3://bucket/prefix``."""
    import pyarrow.fs as pafs  # 0.3 s to import: only where parquet is read

    if not is_remote(location):
        return pafs.LocalFileSystem(), str(Path(location).expanduser().resolve())
    try:
        fs, path = pafs.FileSystem.from_uri(location.rstrip("/"))
    except (OSError, ValueError) as exc:
        raise ConfigError("data.path", location, _s3_hint("cannot open it", exc)) from None
    return fs, path


def join(root: str, *parts: str) -> str:
    return "/".join((root.rstrip("/"), *parts))


def list_shards(location: str, split: str) -> list[str]:
    """The sorted ``*.parquet`` files of ``location/split`` (none if the folder is missing)."""
    import pyarrow.fs as pafs  # 0.3 s to import: only where parquet is read

    fs, root = open_location(location)
    selector = pafs.FileSelector(join(root, split), allow_not_found=True)
    try:
        infos = fs.get_file_info(selector)
    except OSError as exc:
        raise ConfigError("data.path", location, _s3_hint("cannot list it", exc)) from None
    return sorted(
        info.path
        for info in infos
        if info.type == pafs.FileType.File and info.path.endswith(".parquet")
    )


def _s3_hint(failed: str, exc: Exception) -> str:
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    where = f"the endpoint {endpoint}" if endpoint else "AWS (AWS_ENDPOINT_URL is not set)"
    keys = "set" if os.environ.get("AWS_ACCESS_KEY_ID") else "not set"
    return (
        f"{failed} ({detail}); reading from {where} with AWS_ACCESS_KEY_ID {keys}: set "
        "AWS_ENDPOINT_URL for an S3-compatible server and credentials that can read there"
    )


@dataclass(frozen=True)
class RowGroup:
    """One row group of one shard, and where its rows start in the split."""

    shard: str
    index: int
    rows: int
    start: int


def scan_shards(location: str, shards: list[str]) -> tuple[list[RowGroup], Any]:
    """Every row group of ``shards`` (footers only) and their common schema. Refuses, naming
    the shard, an empty shard or one whose columns differ from the first's."""
    import pyarrow.parquet as pq  # 0.3 s to import: only where parquet is read

    fs, _ = open_location(location)
    groups: list[RowGroup] = []
    schema: Any = None
    first = ""
    start = 0
    for shard in shards:
        try:
            with fs.open_input_file(shard) as handle:
                metadata = pq.ParquetFile(handle).metadata
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                "data.path", location, f"cannot read shard {shard}: {detail}"
            ) from None
        if metadata.num_rows == 0:
            raise ConfigError(
                "data.path", location, f"shard {shard} holds no rows; every shard needs rows"
            )
        found = metadata.schema.to_arrow_schema()
        if schema is None:
            schema, first = found, shard
        elif not found.equals(schema):
            raise ConfigError("data.path", location, schema_difference(first, schema, shard, found))
        for index in range(metadata.num_row_groups):
            rows = metadata.row_group(index).num_rows
            if rows:
                groups.append(RowGroup(shard, index, rows, start))
                start += rows
    return groups, schema


def scan_splits(location: str, splits: tuple[str, ...]) -> dict[str, tuple[list[RowGroup], Any]]:
    """``scan_shards`` of each split folder that has shards; refuses splits whose columns
    differ from the first's, naming a shard of each."""
    scanned = {}
    for split in splits:
        shards = list_shards(location, split)
        if shards:
            scanned[split] = scan_shards(location, shards)
    first_groups, schema = next(iter(scanned.values()))
    for groups, other in scanned.values():
        if not other.equals(schema):
            difference = schema_difference(first_groups[0].shard, schema, groups[0].shard, other)
            raise ConfigError("data.path", location, difference)
    return scanned


def shard_identity(location: str, groups: list[RowGroup]) -> list[Any]:
    """Each shard's path, size and modification time: what a cache keyed on a split's content
    checks, without reading the shards."""
    fs, _ = open_location(location)
    shards = list(dict.fromkeys(g.shard for g in groups))
    return [[i.path, i.size, str(i.mtime)] for i in fs.get_file_info(shards)]


def schema_difference(first: str, expected: Any, shard: str, found: Any) -> str:
    for field in expected:
        other = found.field(field.name) if field.name in found.names else None
        if other is None:
            return f"shard {shard} has no column {field.name!r}, which {first} has"
        if not other.type.equals(field.type):
            return (
                f"shard {shard} column {field.name!r} is {other.type}, but {field.type} in {first}"
            )
    extra = [name for name in found.names if name not in expected.names]
    if extra:
        return f"shard {shard} has a column {extra[0]!r} that {first} does not; shards must agree"
    return (
        f"shard {shard} has the columns of {first} in another order or with other "
        f"nullability ({found.names} against {expected.names}); shards must agree"
    )


class ShardedSplit:
    """A split's row groups with a decoder: a dataset read one row group at a time."""

    def __init__(
        self,
        location: str,
        groups: list[RowGroup],
        columns: list[str],
        decode: Decode,
        target_column: str,
    ) -> None:
        self.location = location
        self.groups = groups
        self.columns = columns
        self.decode = decode
        self.target_column = target_column
        self._cached: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._open = threading.local()

    def __len__(self) -> int:
        last = self.groups[-1] if self.groups else None
        return last.start + last.rows if last else 0

    def read(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoded (inputs, targets) of the ``position``-th row group."""
        return self.decode(self.read_table(position), self.groups[position].shard)

    def read_table(self, position: int, columns: list[str] | None = None) -> Any:
        group = self.groups[position]
        return self._shard(group.shard).read_row_group(group.index, columns=columns or self.columns)

    def _shard(self, shard: str) -> Any:
        """The open ``pq.ParquetFile`` of ``shard``, kept for the next row groups of this
        thread: its footer is parsed once (on S3, fetched once), not at every row group."""
        import pyarrow.parquet as pq  # 0.3 s to import: only where parquet is read

        files: OrderedDict[str, Any] | None = getattr(self._open, "files", None)
        if files is None:
            files = self._open.files = OrderedDict()
        if shard in files:
            files.move_to_end(shard)
            return files[shard]
        fs, _ = open_location(self.location)
        files[shard] = pq.ParquetFile(fs.open_input_file(shard))
        if len(files) > OPEN_SHARDS:
            files.popitem(last=False)[1].close()
        return files[shard]

    def group_of(self, row: int) -> int:
        """The position of the row group that holds ``row``."""
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} of a split of {len(self)}")
        return bisect.bisect_right([g.start for g in self.groups], row) - 1

    def __getitem__(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        position = self.group_of(row)
        if self._cached is None or self._cached[0] != position:
            self._cached = (position, self.read(position))
        x, y = self._cached[1]
        offset = row - self.groups[position].start
        return x[offset], y[offset]

    def targets_head(self, limit: int) -> torch.Tensor:
        """The first ``limit`` targets, read from the target column alone (no inputs decoded)."""
        import torch  # see the module's docstring

        values: list[Any] = []
        column = self.target_column
        for position in range(len(self.groups)):
            if len(values) >= limit:
                break
            values += self.read_table(position, [column]).column(column).to_pylist()
        return torch.tensor(values[:limit])

    def __getstate__(self) -> dict[str, Any]:
        # What goes to a Ray task is the recipe, not this process's reads and open files.
        return {**self.__dict__, "_cached": None, "_open": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _open=threading.local())
