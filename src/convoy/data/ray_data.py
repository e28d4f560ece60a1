"""The ``ray_data`` loader: a Ray Data pipeline per split, streamed into Ray Train workers.

Driver side (``build_ray_data``): the configured source is read as for the torch loader (the
same records, the same splits, the same bad-record policy), then turned into Ray Datasets.
A parquet train split used whole is not read by the driver at all: Ray Data's parquet reader
streams its shards (the driver checks only the label column).

- encoded images (imagefolder, parquet) become rows ``{index, path | image bytes, label}``;
  decoding, resizing and scaling run in ``map_batches`` on CPU;
- arrays (digits, synthetic, cifar10, numpy) become a tensor column; scaling and
  normalization run in ``map_batches``;
- every other source (sensor series, table rows, packed token sequences, user datasets)
  becomes tensor columns ``x`` and ``y`` of its finished samples, so a batch is exactly the
  torch loader's collate of the same rows;
- training rows are reshuffled every epoch in two cheap stages, as Ray Data recommends for
  large data: the order of blocks (``randomize_block_order``, seeded by ``run.seed`` and
  reseeded per epoch), then rows within a buffer on each worker (``local_shuffle_buffer_size``
  of ``iter_torch_batches``, seeded by run.seed, epoch and rank). A global
  ``random_shuffle`` would move every image's bytes through an all-to-all exchange each
  epoch (measured 7x slower on 2 cores). Augmentation (random shift, flip) is seeded by the
  rows in each batch;
- preprocessing runs as Ray tasks or an actor pool (``data.ray_data.compute``, ``concurrency``)
  inside the CPUs reserved for Ray Data (``cpu_shares``).

Train is split over the workers by Ray Train (``streaming_split(equal=True)``): each worker
gets floor(N / W) rows per epoch, in micro-batches with drop_last, so every epoch sees
``floor(floor(N / W) / micro) * micro * W`` samples, each at most once (the remainder rule).
Evaluation does not use that split, since it drops rows: the driver cuts each eval split into
one contiguous dataset per rank (``val_0``, ``val_1``, ...), so every row is read exactly once
(preprocessed once and cached in the object store when small: ``cache_eval_mib``);
ranks with fewer rows pad with masked batches so sharded models run the same collectives.

Worker side (``ray_worker_data``): ``get_dataset_shard`` + ``iter_torch_batches`` with
prefetching, behind the engine's ``TrainBatches`` / ``EvalBatches`` interfaces. Mid-epoch
resume skips the batches already trained; which rows they are is not reproduced, because the
streaming split hands blocks to whichever worker asks first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convoy.config import Job
from convoy.data.base import SizedDataset, Splits, TensorImageDataset, augment
from convoy.data.encoded import EncodedImageDataset, ImageRecord, decode_record, rgb_to_tensor
from convoy.data.loaders import Batch, WorkerData
from convoy.data.parquet import (
    COLUMNS,
    check_train_labels,
    load_parquet,
    shard_files,
    streams_whole_train,
)
from convoy.data.registry import load_splits
from convoy.data.samplers import eval_rows_per_rank
from convoy.data.shards import ShardedSplit

EVAL_SPLITS = ("val", "test")
ROWS_PER_BLOCK = 256
"""Rows per block of in-memory sources: blocks are what the block-order shuffle permutes."""


# ---------------------------------------------------------------------------------------------
# Preprocessing (runs in Ray Data tasks or actors)


@dataclass(frozen=True)
class Preprocess:
    """What ``map_batches`` does to a batch of raw rows: decode or scale, then augment."""

    kind: str
    """"encoded": rows hold a file path or encoded bytes; "array": a raw image tensor;
    "tensor": finished samples ``x`` and targets ``y`` (sensor series, table rows, token
    sequences), passed through."""
    image_size: int = 0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    scale: float = 1.0
    crop_padding: int = 0
    flip: bool = False
    seed: int = 0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.kind == "tensor":  # the source already made the samples
            return {"index": batch["index"], "x": batch["x"], "y": batch["y"]}
        images = self._decode(batch) if self.kind == "encoded" else self._scale(batch["image"])
        # Only what training needs leaves the pipeline (no bytes, paths or names).
        if self.crop_padding or self.flip:
            images = self._augment(images, batch["index"])
        labels = np.asarray(batch["label"], dtype=np.int64)
        return {"index": batch["index"], "x": images.numpy(), "y": labels}

    def _decode(self, batch: dict[str, np.ndarray]) -> torch.Tensor:
        decoded = []
        for i, name in enumerate(batch["name"]):
            record = (
                ImageRecord(str(name), 0, path=Path(str(batch["path"][i])))
                if "path" in batch
                else ImageRecord(str(name), 0, data=bytes(batch["image"][i]))
            )
            decoded.append(rgb_to_tensor(decode_record(record, self.image_size)))
        return torch.stack(decoded)

    def _scale(self, raw: np.ndarray) -> torch.Tensor:
        images = torch.from_numpy(np.array(raw, dtype=np.float32)) * self.scale
        if self.mean:
            mean = torch.tensor(self.mean).view(1, -1, 1, 1)
            std = torch.tensor(self.std).view(1, -1, 1, 1)
            images = (images - mean) / std
        return images

    def _augment(self, images: torch.Tensor, indices: np.ndarray) -> torch.Tensor:
        # Seeded by the rows in the batch: reproducible for a given order, and different every
        # epoch because the shuffle changes which rows share a batch.
        generator = torch.Generator().manual_seed(hash((self.seed, *indices.tolist())) % 2**63)
        fill = -1.0 if self.kind == "encoded" else float(self._normalized_zero())
        return torch.stack(
            [augment(img, self.crop_padding, self.flip, fill, generator) for img in images]
        )

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
    names a row group and the slice of it to read; out come its decoded samples."""

    split: ShardedSplit

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        xs, ys, index = [], [], []
        for position, lo, hi in zip(batch["position"], batch["lo"], batch["hi"], strict=True):
            x, y = self.split.read(int(position))
            xs.append(x[lo:hi].numpy())
            ys.append(y[lo:hi].numpy())
            index.append(np.arange(lo, hi) + self.split.groups[int(position)].start)
        return {"index": np.concatenate(index), "x": np.concatenate(xs), "y": np.concatenate(ys)}


Transform = Preprocess | ReadRowGroups


def _run(preprocess: Transform, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return preprocess(batch)


# ---------------------------------------------------------------------------------------------
# Driver side: sources -> Ray Datasets


@dataclass
class RayDataPlan:
    """Datasets for ``TorchTrainer(datasets=...)`` and what workers need to know about them."""

    datasets: dict[str, Any]
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
            "shape": self.shape,
            "sizes": self.sizes,
            "eval_rows": self.eval_rows,
            "sample": self.sample,
            "skipped": list(self.skipped),
            "meta": self.meta,
        }


def _raw_rows(dataset: SizedDataset, rows: range) -> tuple[Any, Transform]:
    """A Ray Dataset of ``rows`` of a source dataset, and how to preprocess it."""
    import ray.data

    if isinstance(dataset, ShardedSplit):  # streamed: one item per row group, read in tasks
        items = row_group_slices(dataset, rows)
        return ray.data.from_items(items, override_num_blocks=max(1, len(items))), ReadRowGroups(
            dataset
        )
    index = np.arange(rows.start, rows.stop)
    if isinstance(dataset, TensorImageDataset):
        images = dataset.images[rows.start : rows.stop].numpy()
        labels = dataset.labels[rows.start : rows.stop].numpy()
        preprocess = Preprocess(
            "array",
            int(images.shape[-1]),
            tuple(dataset.mean.flatten().tolist()),
            tuple(dataset.std.flatten().tolist()),
            dataset.scale,
            dataset.crop_padding,
            dataset.flip,
        )
        return _from_columns({"index": index, "image": images, "label": labels}), preprocess
    if isinstance(dataset, EncodedImageDataset):
        items = [_encoded_row(i, dataset.records[i]) for i in rows]
        preprocess = Preprocess(
            "encoded", dataset.image_size, crop_padding=dataset.crop_padding, flip=dataset.flip
        )
        num_blocks = max(1, math.ceil(len(items) / ROWS_PER_BLOCK))
        return ray.data.from_items(items, override_num_blocks=num_blocks), preprocess
    # Any other source (sensor series, table rows, packed token sequences, user datasets)
    # hands over finished samples.
    x, y = sample_arrays(dataset, rows)
    return _from_columns({"index": index, "x": x, "y": y}), Preprocess("tensor")


def row_group_slices(split: ShardedSplit, rows: range) -> list[dict[str, int]]:
    """The row groups that hold ``rows``, each with the slice of it inside them."""
    slices = []
    for position, group in enumerate(split.groups):
        lo, hi = max(rows.start - group.start, 0), min(rows.stop - group.start, group.rows)
        if lo < hi:
            slices.append({"position": position, "lo": lo, "hi": hi})
    return slices


def sample_arrays(dataset: SizedDataset, rows: range) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` of a dataset as two stacked arrays (inputs, targets), as the DataLoader's
    collate makes them; every sample must have the same shapes."""
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) == 2:  # a TensorDataset: no per-item calls
        return tensors[0][rows.start : rows.stop].numpy(), tensors[1][
            rows.start : rows.stop
        ].numpy()
    first = [torch.as_tensor(t) for t in dataset[rows.start if len(rows) else 0]]
    x = np.empty((len(rows), *first[0].shape), dtype=first[0].numpy().dtype)
    y = np.empty((len(rows), *first[1].shape), dtype=first[1].numpy().dtype)
    for i, row in enumerate(rows):
        sample, target = dataset[row]
        x[i], y[i] = torch.as_tensor(sample).numpy(), torch.as_tensor(target).numpy()
    return x, y


def _from_columns(columns: dict[str, np.ndarray]) -> Any:
    """A Ray Dataset of numpy columns in blocks of ``ROWS_PER_BLOCK`` rows: 1-D columns as
    plain arrays, the others as Ray's tensor extension type (one fixed-shape tensor per row)."""
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


def cpu_shares(job: Job) -> tuple[float, float]:
    """CPUs per Ray Data task and per preprocessing actor, within ``reserved_cpus``.

    An actor pool holds its CPUs for the whole epoch; the shuffle and the eval datasets still
    need tasks meanwhile, so actors take half the reservation and tasks the other half.
    Without actors, tasks may use all of it (at most one CPU each).
    """
    cfg = job.data.ray_data
    if cfg.compute == "tasks":
        return min(1.0, cfg.reserved_cpus), 0.0
    pool = cfg.concurrency or 1
    return min(1.0, cfg.reserved_cpus / 2), cfg.reserved_cpus / 2 / pool


def _preprocessed(ds: Any, preprocess: Transform, job: Job, train: bool) -> Any:
    import ray.data

    cfg = job.data.ray_data
    task_cpus, actor_cpus = cpu_shares(job)
    # A row group is one call: its rows come out together, however many they are.
    batch_size = 1 if isinstance(preprocess, ReadRowGroups) else cfg.batch_size
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
        functools.partial(_run, preprocess),
        batch_size=batch_size,
        batch_format="numpy",
        compute=ray.data.TaskPoolStrategy(size=cfg.concurrency),
        num_cpus=task_cpus,
        **placement,
    )


def build_ray_data(job: Job, world_size: int) -> RayDataPlan:
    """Read the configured source and build every split's Ray Dataset (in the driver)."""
    from ray.data._internal.random_config import RandomSeedConfig

    streamed = streams_whole_train(job.data)
    splits = load_parquet(job.data, read_train=False) if streamed else load_splits(job.data)
    datasets: dict[str, Any] = {}
    preprocess: Transform
    if streamed:
        train, preprocess, train_rows = _parquet_train(job)
    else:
        train, preprocess = _raw_rows(splits.train, range(len(splits.train)))
        train_rows = len(splits.train)
    if isinstance(preprocess, Preprocess):
        preprocess = replace(preprocess, seed=job.run.seed)
    shuffled = train.randomize_block_order(
        seed=RandomSeedConfig(seed=job.run.seed, reseed_after_execution=True)
    )
    datasets["train"] = _preprocessed(shuffled, preprocess, job, train=True)
    eval_rows: dict[str, list[int]] = {}
    sample = sample_spec(splits)
    cache = _eval_bytes(splits, sample) <= job.data.ray_data.cache_eval_mib * 2**20
    for split in EVAL_SPLITS:
        dataset = getattr(splits, split)
        eval_rows[split] = eval_rows_per_rank(len(dataset), world_size)
        start = 0
        for rank, rows in enumerate(eval_rows[split]):
            raw, transform = _raw_rows(dataset, range(start, start + rows))
            chunk = _preprocessed(raw, transform, job, train=False)
            # Preprocessed once and kept in the object store: a streamed eval split starts
            # its tasks again at every evaluation (measured: 10 s of a 11 s digits epoch).
            datasets[f"{split}_{rank}"] = chunk.materialize() if cache else chunk
            start += rows
    sizes = {"train": train_rows, "val": len(splits.val), "test": len(splits.test)}
    return RayDataPlan(
        datasets, splits.shape, sizes, eval_rows, sample, splits.skipped, splits.meta
    )


def sample_spec(splits: Splits) -> list[Any]:
    """[(shape, torch dtype name) of one input, of one target], from one eval sample."""
    split = splits.val if len(splits.val) else splits.test
    sample = [torch.as_tensor(t) for t in split[0]]  # targets may be Python numbers
    return [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in sample]


def _eval_bytes(splits: Splits, sample: list[Any]) -> int:
    """What the preprocessed val and test splits take as tensors."""
    per_row = sum(math.prod(shape) * getattr(torch, dtype).itemsize for shape, dtype in sample)
    return (len(splits.val) + len(splits.test)) * per_row


def _parquet_train(job: Job) -> tuple[Any, Preprocess, int]:
    """Train shards read by Ray Data's parquet reader, in tasks; the driver reads only labels."""
    import ray.data

    rows = check_train_labels(job.data)
    shards = shard_files(Path(str(job.data.path)).expanduser() / "train")
    dataset = ray.data.read_parquet([str(s) for s in shards], columns=list(COLUMNS))
    preprocess = Preprocess(
        "encoded",
        job.data.image_size or 32,
        crop_padding=job.data.augment_crop_padding,
        flip=job.data.augment_flip,
    )
    return dataset, preprocess, rows


# ---------------------------------------------------------------------------------------------
# Worker side: shards -> the engine's batches


def _as_batch(batch: dict[str, torch.Tensor], seen: list[int] | None) -> Batch:
    if seen is not None:
        seen += batch["index"].tolist()
    return batch["x"], batch["y"]


class RayTrainBatches:
    """This worker's share of each epoch, in micro-batches (drop_last)."""

    def __init__(
        self,
        shard: Any,
        micro_batch: int,
        micro_batches: int,
        prefetch: int,
        shuffle_buffer: int,
        seed: int,
        accum: int = 1,
    ) -> None:
        self.shard = shard
        self.micro_batch = micro_batch
        self.micro_batches = micro_batches
        self.prefetch = prefetch
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.epoch = 0
        self.skip_micro = 0
        self.accum = accum
        """Micro-batches per optimizer step: a resumed step count skips this many each."""
        self.seen: list[int] | None = None
        """Set to a list to record the row indices handed out (for audits and tests)."""

    def __len__(self) -> int:
        return self.micro_batches

    def start_epoch(self, epoch: int, skip_steps: int = 0) -> None:
        self.epoch = epoch
        self.skip_micro = skip_steps * self.accum

    def __iter__(self) -> Iterator[Batch]:
        batches = self.shard.iter_torch_batches(
            batch_size=self.micro_batch,
            drop_last=True,
            prefetch_batches=self.prefetch,
            local_shuffle_buffer_size=self.shuffle_buffer or None,
            local_shuffle_seed=self.seed + 1000 * self.epoch if self.shuffle_buffer else None,
            device="cpu",
        )
        iterator = iter(batches)
        for i, batch in enumerate(iterator):
            if i == self.micro_batches - 1:
                # Finish this worker's pass before handing over the last batch, so the split
                # never waits on a half-read epoch (drop_last may leave one partial batch).
                for _ in iterator:
                    pass
            if i >= self.skip_micro:
                yield _as_batch(batch, self.seen)
            if i == self.micro_batches - 1:
                return


class RayEvalBatches:
    """This rank's contiguous chunk of an eval split, padded to the common batch count."""

    def __init__(
        self, shard: Any, batch_size: int, rows: list[int], rank: int, sample: list[Any]
    ) -> None:
        self.shard = shard
        self.batch_size = batch_size
        self.num_real = rows[rank]
        self.batches = math.ceil(max(rows) / batch_size)
        self.sample = sample
        """[(shape, dtype) of one input, of one target]: what a padding batch looks like."""
        self.seen: list[int] | None = None
        """Set to a list to record the row indices read (for audits and tests)."""

    def __iter__(self) -> Iterator[Batch]:
        produced = 0
        last: Batch | None = None
        if self.num_real:
            for batch in self.shard.iter_torch_batches(batch_size=self.batch_size, device="cpu"):
                last = _as_batch(batch, self.seen)
                produced += 1
                yield last
        while produced < self.batches:  # masked padding: the same forwards on every rank
            yield last if last is not None else self._empty()
            produced += 1

    def _empty(self) -> Batch:
        (x_shape, x_dtype), (y_shape, y_dtype) = self.sample
        return (
            torch.zeros(1, *x_shape, dtype=getattr(torch, x_dtype)),
            torch.zeros(1, *y_shape, dtype=getattr(torch, y_dtype)),
        )


def ray_worker_data(job: Job, info: dict[str, Any], rank: int, world_size: int) -> WorkerData:
    """This Ray Train worker's data, from its dataset shards (``get_dataset_shard``)."""
    import ray.train

    accum = job.optim.grad_accum_steps
    micro = job.data.batch_size // (world_size * accum)
    rows_per_worker = info["sizes"]["train"] // world_size
    train = RayTrainBatches(
        ray.train.get_dataset_shard("train"),
        micro,
        (rows_per_worker // micro) // accum * accum,
        job.data.ray_data.prefetch_batches,
        job.data.ray_data.shuffle_buffer_rows,
        seed=job.run.seed * 7919 + rank,
        accum=accum,
    )
    evals = {
        split: RayEvalBatches(
            ray.train.get_dataset_shard(f"{split}_{rank}"),
            job.data.eval_batch_size,
            info["eval_rows"][split],
            rank,
            info["sample"],
        )
        for split in EVAL_SPLITS
    }
    return WorkerData(
        train,
        evals["val"],
        evals["test"],
        info["shape"],
        info["sizes"],
        tuple(info["skipped"]),
        info["meta"],
    )
