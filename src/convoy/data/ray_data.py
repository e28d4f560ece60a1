"""The ``ray_data`` loader: a Ray Data pipeline per split, streamed into Ray Train workers.

Driver side (``build_ray_data``): the configured source is read as for the torch loader (the
same records, the same splits, the same bad-record policy), then turned into Ray Datasets.
A parquet train split used whole is not read by the driver at all: the tasks read its row
groups (the driver checks only the footers and the label column).

- encoded images (imagefolder, parquet) become rows ``{index, path | image bytes, label}``;
  decoding, resizing and scaling run in ``map_batches`` on CPU;
- arrays (digits, synthetic, cifar10, numpy) become a tensor column; scaling and
  normalization run in ``map_batches``;
- streamed sources (``series``, a sharded text corpus) are read, decoded, tokenized and packed
  in the tasks, one row group per call;
- every other source (sensor series, table rows, packed token sequences, user datasets)
  becomes tensor columns ``x`` and ``y`` of its finished samples (inputs that are a dict of
  tensors, as ``sft``'s ``input_ids`` and ``position_ids``, a column ``x.<key>`` each), so a
  batch is exactly the torch loader's collate of the same rows;
- preprocessing runs as Ray tasks or an actor pool (``data.ray_data.compute``, ``concurrency``)
  inside the CPUs reserved for Ray Data (``cpu_shares``).

Training is planned, not split on demand. The driver cuts the train split into units: the row
groups of a streamed source (read in the tasks, never by the driver), or chunks of an in-memory
one (put in the object store once: ``chunk_rows`` rows drawn at random, seeded, few enough that
every rank gets 16 chunks or more). Each worker then runs the torch loader's streamed plan
(``PlannedTrainBatches``, in ``convoy.data.ray_data_worker``) over them: units dealt to the
ranks once, seeded; every epoch a new seeded order of its units, rows permuted within windows
of units (``shuffle_row_groups`` row groups, or ``shuffle_buffer_rows`` rows of chunks);
``floor(min rank rows / share)`` steps for every rank, so each row is trained at most once per
epoch. The worker reads its epoch through a Ray Dataset of its own (``from_items`` of its units
in order, the map stage, ``preserve_order``), so the tasks run ahead of training, bounded by
the object store share each worker's pipeline may use (``OBJECT_STORE_SHARE / world_size``),
and on the nodes ``data.ray_data.resources`` names. Augmentation is seeded by run.seed, the
epoch and the rows.

The order depends only on the seeds and the unit sizes, so a resume ``k`` steps into an epoch
continues with exactly the rows not yet trained, in the same order, with the same
augmentation: units wholly trained are not read again. A streamed source gets the same units,
order and batches as with the torch loader.

Evaluation: the driver cuts each eval split into one contiguous dataset per rank (``val_0``,
``val_1``, ...), so every row is read exactly once (preprocessed once and cached in the object
store when small: ``cache_eval_mib``); ranks with fewer rows pad with masked batches so sharded
models run the same collectives. Workers read them with ``get_dataset_shard`` +
``iter_torch_batches``.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convoy.config import Job
from convoy.data.base import Collated, SizedDataset, Splits, TensorImageDataset
from convoy.data.encoded import EncodedImageDataset
from convoy.data.image_records import ImageRecord
from convoy.data.parquet import (
    COLUMNS,
    check_train_labels,
    load_parquet,
    streams_whole_train,
)
from convoy.data.ray_data_stages import (
    INPUTS,
    Preprocess,
    PreprocessActor,
    ReadChunks,
    ReadRowGroups,
    TrainUnits,
    Transform,
    as_columns,
    from_columns,
    input_columns,
    raw_rows_only,
    run_transform,
)
from convoy.data.registry import load_splits
from convoy.data.samplers import eval_rows_per_rank
from convoy.data.shards import ShardedSplit, list_shards, scan_shards

EVAL_SPLITS = ("val", "test")
ROWS_PER_BLOCK = 256
"""Rows per block of in-memory sources: blocks are what the block-order shuffle permutes."""


# ---------------------------------------------------------------------------------------------
# Driver side: sources -> Ray Datasets


@dataclass
class RayDataPlan:
    """Datasets for ``TorchTrainer(datasets=...)`` and what workers need to know about them."""

    datasets: dict[str, Any]
    """The eval splits' datasets, one per rank (``val_0``, ``test_1``, ...)."""
    train: TrainUnits
    shape: dict[str, int]
    sizes: dict[str, int]
    eval_rows: dict[str, list[int]]
    """Rows of each eval split per rank."""
    sample: list[Any]
    """[(shape, torch dtype name) of one input, of one target]."""
    skipped: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    """The source's facts for the task and the summary (``Splits.meta``, plain values)."""

    def worker_info(self) -> dict[str, Any]:
        return {
            "train": self.train,
            "shape": self.shape,
            "sizes": self.sizes,
            "eval_rows": self.eval_rows,
            "sample": self.sample,
            "skipped": list(self.skipped),
            "meta": self.meta,
        }


def _raw_rows(dataset: SizedDataset, rows: range) -> tuple[Any, Transform]:
    """A Ray Dataset of ``rows`` of a source dataset, and how to preprocess it."""
    import ray.data  # the ray extra

    if isinstance(dataset, ShardedSplit):  # streamed: one item per row group, read in tasks
        items = row_group_slices(dataset, rows)
        return ray.data.from_items(items, override_num_blocks=max(1, len(items))), ReadRowGroups(
            dataset
        )
    if isinstance(dataset, EncodedImageDataset):
        items = [_encoded_row(i, dataset.records[i]) for i in rows]
        num_blocks = max(1, math.ceil(len(items) / ROWS_PER_BLOCK))
        return ray.data.from_items(items, override_num_blocks=num_blocks), _preprocess_of(dataset)
    return _from_columns(_raw_columns(dataset, rows)), _preprocess_of(dataset)


def _preprocess_of(dataset: SizedDataset) -> Preprocess:
    """What the map stage does to an in-memory source's raw rows."""
    if isinstance(dataset, TensorImageDataset):
        return Preprocess(
            "array",
            int(dataset.images.shape[-1]),
            tuple(dataset.mean.flatten().tolist()),
            tuple(dataset.std.flatten().tolist()),
            dataset.scale,
            dataset.crop_padding,
            dataset.flip,
        )
    if isinstance(dataset, EncodedImageDataset):
        return Preprocess(
            "encoded", dataset.image_size, crop_padding=dataset.crop_padding, flip=dataset.flip
        )
    # Any other source (sensor series, table rows, packed token sequences, user datasets)
    # hands over finished samples.
    return Preprocess("tensor")


def _raw_columns(dataset: SizedDataset, rows: RowSet) -> dict[str, np.ndarray]:
    """``rows`` of an in-memory source as the numpy columns its ``Preprocess`` takes."""
    index = np.asarray(rows, dtype=np.int64)
    if isinstance(dataset, TensorImageDataset):
        images, labels = _take(dataset.images, rows), _take(dataset.labels, rows)
        return {"index": index, "image": images.numpy(), "label": labels.numpy()}
    if isinstance(dataset, EncodedImageDataset):
        records = [_encoded_row(int(i), dataset.records[int(i)]) for i in index]
        columns = {name: np.array([r[name] for r in records], dtype=object) for name in records[0]}
        return {**columns, "index": index, "label": columns["label"].astype(np.int64)}
    x, y = sample_arrays(dataset, rows)
    return {"index": index, **as_columns(x), "y": y}


def chunk_rows(rows: int, world_size: int) -> int:
    """Rows per chunk of an in-memory train split: at most ``ROWS_PER_BLOCK``, and small enough
    that every rank gets 16 or more, so dealing whole chunks leaves the ranks within one
    chunk of each other."""
    return max(1, min(ROWS_PER_BLOCK, rows // (world_size * 16)))


def _train_units(job: Job, train: SizedDataset, world_size: int) -> TrainUnits:
    import ray  # the ray extra

    if isinstance(train, ShardedSplit):
        read = ReadRowGroups(train)
        return _group_units(train, read, job.data.shuffle_row_groups)
    size = chunk_rows(len(train), world_size)
    # Chunks of rows drawn at random (seeded), not runs of neighbours: a source stored in
    # class order (an image folder) would otherwise give windows of a few classes.
    order = np.random.default_rng([job.run.seed, 11]).permutation(len(train))
    starts = range(0, len(train), size)
    raw = [_raw_columns(train, order[start : start + size]) for start in starts]
    return TrainUnits(
        rows=[min(size, len(train) - start) for start in starts],
        items=[{"position": p} for p in range(len(raw))],
        read=ReadChunks(tuple(ray.put(chunk) for chunk in raw), _preprocess_of(train)),
        window=max(1, job.data.ray_data.shuffle_buffer_rows // size),
        # Raw columns that a preprocessing step turns into ``x`` (encoded images) name no
        # input column yet: then the inputs are ``x``.
        inputs=tuple(input_columns(raw[0]) if raw else ()) or (INPUTS,),
    )


def _group_units(split: ShardedSplit, read: ReadRowGroups, window: int) -> TrainUnits:
    items = row_group_slices(split, range(len(split)))  # the row groups that hold rows
    return TrainUnits([i["hi"] - i["lo"] for i in items], items, read, window)


def row_group_slices(split: ShardedSplit, rows: range) -> list[dict[str, int]]:
    """The row groups that hold ``rows``, each with the slice of it inside them."""
    slices = []
    for position, group in enumerate(split.groups):
        lo, hi = max(rows.start - group.start, 0), min(rows.stop - group.start, group.rows)
        if lo < hi:
            slices.append({"position": position, "lo": lo, "hi": hi})
    return slices


def sample_arrays(dataset: SizedDataset, rows: RowSet) -> tuple[Any, np.ndarray]:
    """``rows`` of a dataset as stacked arrays (inputs, targets), as the DataLoader's collate
    makes them (inputs that are a dict of tensors: a dict of arrays); every sample must have
    the same shapes."""
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) == 2:  # a TensorDataset: no per-item calls
        return _take(tensors[0], rows).numpy(), _take(tensors[1], rows).numpy()
    if hasattr(dataset, "__getitems__") and len(rows):  # built whole per batch (Collated)
        batch = dataset.__getitems__([int(row) for row in rows])
        if isinstance(batch, Collated):
            x, y = batch
            return _numpy(x), _numpy(y)
    first = dataset[int(rows[0]) if len(rows) else 0]
    x_parts = as_columns(first[0])
    x = {name: _empty_rows(len(rows), value) for name, value in x_parts.items()}
    y = _empty_rows(len(rows), first[1])
    for i, row in enumerate(rows):
        sample, target = dataset[int(row)]
        for name, value in as_columns(sample).items():
            x[name][i] = torch.as_tensor(value).numpy()
        y[i] = torch.as_tensor(target).numpy()
    return from_columns(x), y


def _empty_rows(rows: int, value: Any) -> np.ndarray:
    """An array for ``rows`` samples shaped as ``value``."""
    array = torch.as_tensor(value).numpy()
    return np.empty((rows, *array.shape), dtype=array.dtype)


def _numpy(value: Any) -> Any:
    """A tensor (or a dict of them) as numpy."""
    if isinstance(value, dict):
        return {key: _numpy(item) for key, item in value.items()}
    return torch.as_tensor(value).numpy()


RowSet = range | np.ndarray
"""Rows of a split: a range (sliced, no copy) or an array of indices (gathered)."""


def _take(tensor: torch.Tensor, rows: RowSet) -> torch.Tensor:
    if isinstance(rows, range):
        return tensor[rows.start : rows.stop]
    return tensor[torch.from_numpy(np.asarray(rows, dtype=np.int64))]


def _from_columns(columns: dict[str, np.ndarray]) -> Any:
    """A Ray Dataset of numpy columns in blocks of ``ROWS_PER_BLOCK`` rows: 1-D columns as
    plain arrays, the others as Ray's tensor extension type (one fixed-shape tensor per row)."""
    # the ray extra (and pyarrow, 0.3 s to import, for its tensor columns)
    import pyarrow as pa
    import ray.data
    from ray.data.extensions import ArrowTensorArray

    def arrow(values: np.ndarray) -> Any:
        return pa.array(values) if values.ndim == 1 else ArrowTensorArray.from_numpy(values)

    rows = len(next(iter(columns.values())))
    blocks = [
        pa.table({name: arrow(values[i : i + ROWS_PER_BLOCK]) for name, values in columns.items()})
        for i in range(0, max(rows, 1), ROWS_PER_BLOCK)
    ]
    return ray.data.from_arrow(blocks)


def _encoded_row(index: int, record: ImageRecord) -> dict[str, Any]:
    row = {"index": index, "name": record.name, "label": record.label}
    if record.path is not None:
        return {**row, "path": str(record.path)}
    return {**row, "image": record.data}


def cpu_shares(job: Job, pipelines: int = 1) -> tuple[float, float]:
    """CPUs per Ray Data task and per preprocessing actor, within ``reserved_cpus``.

    An actor pool holds its CPUs for the whole epoch; the eval datasets still need tasks
    meanwhile, so actors take half the reservation and tasks the other half. Every train
    worker runs its own pipeline (``pipelines`` of them), each with its own pool, so the
    actors' half is split between them: otherwise one worker's pool could wait for CPUs that
    the others' pools hold while those workers wait for it in a collective. Without actors,
    tasks may use all of it (at most one CPU each).
    """
    cfg = job.data.ray_data
    if cfg.compute == "tasks":
        return min(1.0, cfg.reserved_cpus), 0.0
    pool = cfg.concurrency or 1
    return min(1.0, cfg.reserved_cpus / 2), cfg.reserved_cpus / 2 / pool / pipelines


def preprocessed(ds: Any, preprocess: Transform, job: Job, train: bool, pipelines: int = 1) -> Any:
    """``ds`` with its map stage: ``preprocess`` in Ray tasks, or for ``train`` with
    ``data.ray_data.compute: actors``, in an actor pool (one of ``pipelines``)."""
    import ray.data  # the ray extra

    cfg = job.data.ray_data
    task_cpus, actor_cpus = cpu_shares(job, pipelines)
    # A row group is one call: its rows come out together, however many they are.
    batch_size = 1 if isinstance(preprocess, ReadRowGroups | ReadChunks) else cfg.batch_size
    placement = {"resources": cfg.resources} if cfg.resources else {}
    if train and cfg.compute == "actors":
        return ds.map_batches(
            PreprocessActor,
            fn_constructor_args=(preprocess,),
            batch_size=batch_size,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=cfg.concurrency or 1),
            num_cpus=actor_cpus,
            **placement,
        )
    # Eval datasets always use tasks: they run once per evaluation and must not hold CPUs.
    return ds.map_batches(
        functools.partial(run_transform, preprocess),
        batch_size=batch_size,
        batch_format="numpy",
        compute=ray.data.TaskPoolStrategy(size=cfg.concurrency),
        num_cpus=task_cpus,
        **placement,
    )


def build_ray_data(job: Job, world_size: int) -> RayDataPlan:
    """Read the configured source and build the train units and every eval split's Ray
    Datasets (in the driver)."""
    keep_ray_data_notes_off_the_terminal()
    streamed = streams_whole_train(job.data)
    splits = load_parquet(job.data, read_train=False) if streamed else load_splits(job.data)
    if streamed:
        train, train_rows = _parquet_train(job, world_size)
    else:
        train, train_rows = _train_units(job, splits.train, world_size), len(splits.train)
    datasets: dict[str, Any] = {}
    eval_rows: dict[str, list[int]] = {}
    sample = sample_spec(splits)
    cache = _eval_bytes(splits, sample) <= job.data.ray_data.cache_eval_mib * 2**20
    for split in EVAL_SPLITS:
        dataset = getattr(splits, split)
        eval_rows[split] = eval_rows_per_rank(len(dataset), world_size)
        start = 0
        for rank, rows in enumerate(eval_rows[split]):
            raw, transform = _raw_rows(dataset, range(start, start + rows))
            chunk = preprocessed(raw, transform, job, train=False)
            # Preprocessed once and kept in the object store: a streamed eval split starts
            # its tasks again at every evaluation (measured: 10 s of a 11 s digits epoch).
            datasets[f"{split}_{rank}"] = chunk.materialize() if cache else chunk
            start += rows
    sizes = {"train": train_rows, "val": len(splits.val), "test": len(splits.test)}
    return RayDataPlan(
        datasets, train, splits.shape, sizes, eval_rows, sample, splits.skipped, splits.meta
    )


def keep_ray_data_notes_off_the_terminal() -> None:
    """In this process (the driver, a train worker), Ray Data's notes (each dataset's start,
    plan and end, and its progress where the output is not a terminal) go to Ray Data's log
    (``ray-data.log`` in Ray's session logs) instead of between the run's lines; its warnings
    and errors still reach the terminal. Each rank runs a pipeline per epoch and per
    evaluation: their notes and bars were 430 of a 2-epoch digits run's 1,301 lines. The
    workers' progress is logged, not drawn (``use_ray_tqdm`` off: their bars would reach the
    driver's terminal through Ray's tqdm relay); on a terminal the driver's own short
    pipelines (the evaluation chunks it prepares) still draw Ray Data's bars. A logging
    config the user gave Ray Data (``RAY_DATA_LOGGING_CONFIG``) is left as it is."""
    import ray.data  # the ray extra

    ray.data.DataContext.get_current().use_ray_tqdm = False
    if os.environ.get("RAY_DATA_LOGGING_CONFIG"):
        return
    for handler in logging.getLogger("ray.data").handlers:
        # Ray Data's console handler (its files are written by handlers of their own).
        if isinstance(handler, logging.StreamHandler) and not isinstance(
            handler, logging.FileHandler
        ):
            handler.setLevel(max(handler.level, logging.WARNING))


def sample_spec(splits: Splits) -> list[Any]:
    """[(shape, torch dtype name) of one input (a dict of them for a dict), of one target],
    from one eval sample."""
    split = splits.val if len(splits.val) else splits.test
    return [_spec(value) for value in split[0]]


def _spec(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _spec(item) for key, item in value.items()}
    tensor = torch.as_tensor(value)  # targets may be Python numbers
    return (list(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def _spec_bytes(spec: Any) -> int:
    if isinstance(spec, dict):
        return sum(_spec_bytes(item) for item in spec.values())
    shape, dtype = spec
    return math.prod(shape) * getattr(torch, dtype).itemsize


def _eval_bytes(splits: Splits, sample: list[Any]) -> int:
    """What the preprocessed val and test splits take as tensors."""
    per_row = sum(_spec_bytes(spec) for spec in sample)
    return (len(splits.val) + len(splits.test)) * per_row


def _parquet_train(job: Job, world_size: int) -> tuple[TrainUnits, int]:
    """Train shards read row group by row group in Ray Data's tasks; the driver reads only
    their footers and labels. Row groups too large for every rank to get 16 units are read in
    slices (each slice reads its whole row group: the price of a few large row groups)."""
    rows = check_train_labels(job.data)
    location = str(Path(str(job.data.path)).expanduser())
    groups, _ = scan_shards(location, list_shards(location, "train"))
    split = ShardedSplit(location, groups, list(COLUMNS), raw_rows_only, "label")
    preprocess = Preprocess(
        "encoded",
        job.data.image_size or 32,
        crop_padding=job.data.augment_crop_padding,
        flip=job.data.augment_flip,
    )
    most = max(1, math.ceil(rows / (world_size * 16)))
    items = [
        {"position": item["position"], "lo": lo, "hi": min(lo + most, item["hi"])}
        for item in row_group_slices(split, range(len(split)))
        for lo in range(item["lo"], item["hi"], most)
    ]
    # Whole row groups or slices, whichever is fewer rows; at least shuffle_row_groups of them
    # are shuffled together (shards written in class order mix only across units).
    window = max(job.data.shuffle_row_groups, job.data.ray_data.shuffle_buffer_rows // most)
    read = ReadRowGroups(split, preprocess)
    return TrainUnits([i["hi"] - i["lo"] for i in items], items, read, window), rows
