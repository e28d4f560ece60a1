"""A checkpoint's model written as safetensors shards, read from DCP a shard at a time.

No export holds the whole model. ``checkpoint_tensors`` lists the model's tensors from the
checkpoint's metadata alone (keys, shapes, dtypes; no weight is read). ``plan_shards`` cuts
the tensors to write into shards of at most ``max_shard_size`` bytes, in order, as
``transformers`` does (a tensor bigger than that is a shard of its own). ``write_shards``
then reads one shard's tensors at a time straight from the checkpoint, into tensors made for
them (``dcp.load`` of those keys only, no process group), writes that file and lets them go:
the peak is about one shard plus one tensor's read buffer, not the model.

One shard is ``model.safetensors``; more are ``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map":
{name: file}}``), the layout ``from_pretrained`` loads and ``read_weights`` reads back.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from convoy.checkpoint import ignore_dcp_group_warning
from convoy.errors import ConfigError, ConvoyError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
"""``--max-shard-size``'s default, ``transformers``' own."""

MODEL_PREFIX = "model."
"""Where a checkpoint keeps the model's entries: ``{"model": ..., "optim": ...}``, flattened."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write: its name in the file, its checkpoint key (under ``model``), its
    shape and dtype."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Its size in a safetensors file."""
        return math.prod(self.shape) * self.dtype.itemsize


def parse_size(value: str | int, option: str = "--max-shard-size") -> int:
    """Bytes of a size written as ``5GB`` / ``500MB`` (powers of 1000), ``2GiB`` (powers of
    1024) or a plain number of bytes; a ``ConfigError`` naming ``option`` otherwise."""
    found = _SIZE.match(str(value))
    unit = found.group(2).lower() if found else None
    size = int(float(found.group(1)) * _UNITS[unit]) if found and unit in _UNITS else 0
    if size <= 0:
        raise ConfigError(
            option, value, "a size above 0 like 5GB, 500MB, 2GiB, 64KiB or a number of bytes"
        )
    return size


def checkpoint_tensors(path: Path) -> dict[str, TensorEntry]:
    """The model's tensors in the DCP checkpoint at ``path``, by key (named as their keys),
    from its metadata: no weight is read."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    found = {}
    for flat, held in saved.items():
        if not flat.startswith(MODEL_PREFIX):
            continue
        key = flat.removeprefix(MODEL_PREFIX)
        if not isinstance(held, TensorStorageMetadata):
            raise ConvoyError(
                f"checkpoint {path.name}: the model's entry {key!r} is not a tensor; a "
                "safetensors export holds tensors only"
            )
        found[key] = TensorEntry(key, key, tuple(held.size), held.properties.dtype)
    return found


def plan_shards(entries: Iterable[TensorEntry], max_shard_size: int) -> list[list[TensorEntry]]:
    """``entries`` in order, cut into shards of at most ``max_shard_size`` bytes; a tensor
    bigger than that is a shard of its own (``transformers``' rule). Always one shard at least."""
    shards: list[list[TensorEntry]] = [[]]
    filled = 0
    for entry in entries:
        if shards[-1] and filled + entry.nbytes > max_shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(entry)
        filled += entry.nbytes
    return shards


def shard_files(count: int) -> list[str]:
    """The file names of ``count`` shards, as ``save_pretrained`` names them."""
    if count == 1:
        return [WEIGHTS_FILE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def read_tensors(path: Path, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """These tensors of the DCP checkpoint at ``path`` (only these are read), by name."""
    targets = {entry.key: torch.empty(entry.shape, dtype=entry.dtype) for entry in entries}
    ignore_dcp_group_warning()
    dcp.load({"model": targets}, checkpoint_id=path, no_dist=True)
    return {entry.name: targets[entry.key] for entry in entries}


def write_shards(
    path: Path, entries: list[TensorEntry], out_dir: Path, max_shard_size: int
) -> list[str]:
    """Write ``entries`` of the DCP checkpoint at ``path`` into ``out_dir`` as safetensors
    shards of at most ``max_shard_size`` bytes (plus the index when there are several),
    holding one shard at a time; returns the files written. A previous export's weight
    files there go first, so none is left beside the new ones."""
    shards = plan_shards(entries, max_shard_size)
    files = shard_files(len(shards))
    remove_weights(out_dir)
    for shard, file in zip(shards, files, strict=True):
        save_file(read_tensors(path, shard), str(out_dir / file), metadata={"format": "pt"})
    if len(files) > 1:
        write_index(out_dir, shards, files)
    return files


def write_index(out_dir: Path, shards: list[list[TensorEntry]], files: list[str]) -> None:
    """``model.safetensors.index.json``: the total size and which file holds each tensor."""
    weight_map = {e.name: file for shard, file in zip(shards, files, strict=True) for e in shard}
    total = sum(entry.nbytes for shard in shards for entry in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def remove_weights(out_dir: Path) -> None:
    """Delete the weight files (single, shards, index) an earlier export left in ``out_dir``."""
    for file in out_dir.iterdir():
        if file.name in (WEIGHTS_FILE, INDEX_FILE) or _SHARD_FILE.match(file.name):
            file.unlink()


def weight_files(export_dir: Path) -> list[str]:
    """The safetensors files of an export: the index's shards, else ``model.safetensors``."""
    index = export_dir / INDEX_FILE
    if not index.is_file():
        return [WEIGHTS_FILE]
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    return sorted(set(weight_map.values()))


def read_weights(export_dir: Path) -> dict[str, torch.Tensor]:
    """All the tensors of an export (one file or shards with their index), by name."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(export_dir):
        tensors.update(load_file(str(export_dir / file)))
    return tensors
