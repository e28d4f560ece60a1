"""What Ray Data's map stages run (``Preprocess``, ``ReadChunks``, ``ReadRowGroups``) and the
train units each worker is handed (``TrainUnits``), with the column helpers they share.

Imports no torch: Ray Train's controller unpickles these with the run's config and datasets
and never runs them, and torch would be its dearest import (1-1.3 CPU-s and a few hundred
MB per run). The methods that use torch import it when they first run, in the Ray Data
tasks and the train workers. Without augmentation, images need no torch: an array source is
scaled and normalized in numpy, an image folder and its parquet conversion decode through
``convoy.data.image_records``, and their Ray Data tasks import none (about 1.5 CPU-s a task
worker). A streamed sensor series or text corpus's ``ReadRowGroups`` holds its
``ShardedSplit`` with the source's decoder, whose module imports torch: that run's controller
and tasks still do.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from convoy.data.shards import ShardedSplit

INPUTS = "x"
"""The column of a sample's inputs; ``x.<key>`` for each key of inputs that are a dict."""


# ---------------------------------------------------------------------------------------------
# Preprocessing (runs in Ray Data tasks or actors)


@dataclass(frozen=True)
class Preprocess:
    """What ``map_batches`` does to a batch of raw rows: decode or scale, then augment."""

    kind: str
    """"encoded": rows hold a file path or encoded bytes; "array": a raw image tensor;
    "tensor": finished samples ``x`` (or ``x.<key>`` columns) and targets ``y`` (sensor
    series, table rows, token sequences), passed through."""
    image_size: int = 0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    scale: float = 1.0
    crop_padding: int = 0
    flip: bool = False
    seed: int = 0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.kind == "tensor":  # the source already made the samples
            kept = ("index", "y", *input_columns(batch))
            return {name: batch[name] for name in kept}
        images = self._decode(batch) if self.kind == "encoded" else self._scale(batch["image"])
        # Only what training needs leaves the pipeline (no bytes, paths or names).
        if self.crop_padding or self.flip:
            images = self._augment(images, batch["index"])
        labels = np.asarray(batch["label"], dtype=np.int64)
        return {"index": batch["index"], "x": images, "y": labels}

    def _decode(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        from convoy.data.image_records import ImageRecord, decode_record, rgb_to_array

        decoded = []
        for i, name in enumerate(batch["name"]):
            record = (
                ImageRecord(str(name), 0, path=Path(str(batch["path"][i])))
                if "path" in batch
                else ImageRecord(str(name), 0, data=bytes(batch["image"][i]))
            )
            decoded.append(rgb_to_array(decode_record(record, self.image_size)))
        return np.stack(decoded)

    def _scale(self, raw: np.ndarray) -> np.ndarray:
        # TensorImageDataset's float32 arithmetic, in numpy: each operation is one correctly
        # rounded float32 operation either way, so the samples are the same bit for bit.
        images = np.array(raw, dtype=np.float32) * np.float32(self.scale)
        if self.mean:
            mean = np.array(self.mean, dtype=np.float32).reshape(1, -1, 1, 1)
            std = np.array(self.std, dtype=np.float32).reshape(1, -1, 1, 1)
            images = (images - mean) / std
        return images

    def _augment(self, images: np.ndarray, indices: np.ndarray) -> np.ndarray:
        import torch  # see the module's docstring

        from convoy.data.base import augment

        # Seeded by ``seed`` and the rows in the batch: the train units are read whole, and
        # ``with_seed`` gives every epoch its own seed, so the draws change every epoch and
        # are the same again on a resume.
        generator = torch.Generator().manual_seed(hash((self.seed, *indices.tolist())) % 2**63)
        fill = -1.0 if self.kind == "encoded" else float(self._normalized_zero())
        return torch.stack(
            [
                augment(img, self.crop_padding, self.flip, fill, generator)
                for img in torch.from_numpy(images)
            ]
        ).numpy()

    def _normalized_zero(self) -> float:
        # Array sources pad with black before normalizing, as the torch loader does.
        return -self.mean[0] / self.std[0] if self.mean else 0.0


class PreprocessActor:
    """The actor-pool form of ``Preprocess`` (``data.ray_data.compute: actors``)."""

    def __init__(self, preprocess: Transform) -> None:
        self.preprocess = preprocess

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.preprocess(batch)


@dataclass(frozen=True)
class ReadRowGroups:
    """What ``map_batches`` does for a streamed source (``ShardedSplit``): each input row
    names a row group and the slice of it to read; out come its samples, decoded by the split
    or, for raw rows (encoded image shards), by ``preprocess``."""

    split: ShardedSplit
    preprocess: Preprocess | None = None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = []
        for position, lo, hi in zip(batch["position"], batch["lo"], batch["hi"], strict=True):
            index = np.arange(lo, hi) + self.split.groups[int(position)].start
            if self.preprocess is None:
                x, y = self.split.read(int(position))
                outputs.append({"index": index, "x": x[lo:hi].numpy(), "y": y[lo:hi].numpy()})
                continue
            table = self.split.read_table(int(position)).slice(int(lo), int(hi - lo))
            raw = {
                name: np.array(table.column(name).to_pylist(), dtype=object)
                for name in table.column_names
            }
            outputs.append(self.preprocess({**raw, "index": index}))
        return concat_columns(outputs)

    def with_seed(self, seed: int) -> ReadRowGroups:
        if self.preprocess is None:
            return self
        return replace(self, preprocess=replace(self.preprocess, seed=seed))


@dataclass(frozen=True)
class ReadChunks:
    """What ``map_batches`` does for an in-memory train split: its raw rows were put in the
    object store in chunks once (``TrainUnits``); each input row names a chunk, and out come
    its rows, preprocessed."""

    chunks: tuple[Any, ...]
    """Object references of the chunks: dicts of numpy columns."""
    preprocess: Preprocess

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import ray  # the ray extra

        positions = [int(p) for p in batch["position"]]
        return concat_columns([self.preprocess(ray.get(self.chunks[p])) for p in positions])

    def with_seed(self, seed: int) -> ReadChunks:
        return replace(self, preprocess=replace(self.preprocess, seed=seed))


def concat_columns(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}


def input_columns(columns: Any) -> list[str]:
    """The names among ``columns`` that carry a sample's inputs: ``x``, or ``x.<key>``."""
    return [name for name in columns if name == INPUTS or name.startswith(f"{INPUTS}.")]


def as_columns(inputs: Any) -> dict[str, Any]:
    """Inputs (an array or tensor, or a dict of them) as the columns that carry them."""
    if isinstance(inputs, dict):
        return {f"{INPUTS}.{key}": value for key, value in inputs.items()}
    return {INPUTS: inputs}


def from_columns(columns: dict[str, Any]) -> Any:
    """A batch's inputs from its columns (``as_columns`` undone)."""
    if INPUTS in columns:
        return columns[INPUTS]
    prefix = f"{INPUTS}."
    return {name[len(prefix) :]: v for name, v in columns.items() if name.startswith(prefix)}


Transform = Preprocess | ReadRowGroups | ReadChunks


def raw_rows_only(table: Any, shard: str) -> Any:
    """The ``decode`` of an encoded image shard's split: its rows are decoded by the map
    stage's ``Preprocess`` (``ReadRowGroups``), never by the split (and so with no torch)."""
    raise RuntimeError("encoded image shards are decoded by Preprocess, not by the split")


def run_transform(preprocess: Transform, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The map stage's function (a module-level one, so that Ray pickles it by reference)."""
    return preprocess(batch)


@dataclass
class TrainUnits:
    """The train split as the units each worker plans its epochs over (``PlannedTrainBatches``):
    row groups of a streamed source, or chunks of an in-memory one put in the object store."""

    rows: list[int]
    """Rows of each unit."""
    items: list[dict[str, int]]
    """The input row of the map stage that reads each unit."""
    read: ReadRowGroups | ReadChunks
    window: int
    """Units whose rows are shuffled together."""
    inputs: tuple[str, ...] = (INPUTS,)
    """The columns that carry a sample's inputs (``x``, or ``x.<key>`` of a dict)."""
