"""What the engine iterates, whichever loader feeds it.

``TrainBatches``: this rank's micro-batches of one epoch, with a known length, started per
epoch (and mid-epoch on resume). ``EvalBatches``: this rank's shard of an eval split padded
to the same number of batches on every rank; the first ``num_real`` samples are genuine.
``WorkerData`` bundles them with what the model needs to know about a sample.

The ``torch`` loader implements them with DataLoaders over exact samplers (below); the
``ray_data`` loader with Ray Data shards (``convoy.data.ray_data``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from convoy.data.base import Batch, SizedDataset, Splits, collate
from convoy.data.samplers import GlobalBatchSampler, ShardedEvalSampler
from convoy.data.shards import ShardedSplit
from convoy.data.streaming import StreamedEvalBatches, StreamedTrainBatches


class TrainBatches(Protocol):
    def __len__(self) -> int:
        """Micro-batches of a whole epoch on this rank."""

    def start_epoch(self, epoch: int, skip_steps: int = 0) -> None:
        """Begin ``epoch``, after its first ``skip_steps`` global batches (resuming). Called
        as soon as the epoch is known (before the previous one is evaluated), and again
        right before it is iterated: a loader may start reading at the first call."""

    def __iter__(self) -> Iterator[Batch]: ...


class EvalBatches(Protocol):
    num_real: int
    """Genuine samples on this rank; everything after them is padding."""

    def __iter__(self) -> Iterator[Batch]: ...


@dataclass
class WorkerData:
    """One worker's data: training and eval batches, and the shape of a sample."""

    train: TrainBatches
    val: EvalBatches
    test: EvalBatches
    shape: dict[str, int]
    sizes: dict[str, int]
    """Samples per split, over all ranks."""
    skipped: tuple[str, ...] = field(default=())
    """Records left out under ``data.on_bad_record: skip``."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The source's facts for the task and the summary (``Splits.meta``)."""


class TorchTrainBatches:
    """A DataLoader over ``GlobalBatchSampler``: exact global batches, seeded per epoch."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.sampler: GlobalBatchSampler = loader.sampler  # type: ignore[assignment]

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch * self.sampler.share // self.loader.batch_size  # type: ignore[operator]

    def start_epoch(self, epoch: int, skip_steps: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.sampler.skip(skip_steps)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)


class TorchEvalBatches:
    """A DataLoader over ``ShardedEvalSampler``."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.num_real: int = loader.sampler.num_real  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.loader)


def own_generator(seed: int) -> torch.Generator:
    """A generator for a DataLoader's own draws (its workers' base seed at every ``iter``).

    Without one, each ``iter(loader)`` draws from the global torch RNG that dropout and
    augmentation use, so a run resumed mid-epoch (RNG restored, then a new iterator) would
    continue from a different random stream than the run it resumes.
    """
    return torch.Generator().manual_seed(seed)


def train_loader(
    dataset: SizedDataset,
    global_batch: int,
    micro_batch: int,
    world_size: int,
    rank: int,
    seed: int,
    num_workers: int = 0,
    device: torch.device | None = None,
) -> TorchTrainBatches:
    """Micro-batches of this rank's share of every global batch."""
    sampler = GlobalBatchSampler(dataset, global_batch, world_size, rank, seed=seed)
    return TorchTrainBatches(
        DataLoader(
            dataset,  # type: ignore[arg-type]
            batch_size=micro_batch,
            sampler=sampler,
            num_workers=num_workers,
            pin_memory=device is not None and device.type == "cuda",
            persistent_workers=num_workers > 0,
            generator=own_generator(seed),
            collate_fn=collate,
        )
    )


def eval_loader(
    dataset: SizedDataset, batch_size: int, world_size: int, rank: int, num_workers: int = 0
) -> TorchEvalBatches:
    """Every sample once across ranks (plus masked padding)."""
    sampler = ShardedEvalSampler(dataset, world_size, rank)
    return TorchEvalBatches(
        DataLoader(
            dataset,  # type: ignore[arg-type]
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            generator=own_generator(0),
            collate_fn=collate,
        )
    )


def torch_worker_data(
    splits: Splits,
    global_batch: int,
    micro_batch: int,
    eval_batch: int,
    world_size: int,
    rank: int,
    seed: int,
    num_workers: int = 0,
    device: torch.device | None = None,
    stream_window: int = 4,
    stream_readers: int = 2,
) -> WorkerData:
    """The ``torch`` loader's data for one rank: DataLoaders over exact samplers, or for a
    streamed source (``ShardedSplit``) its row groups read window by window
    (``convoy.data.streaming``; ``stream_window`` row groups at a time, ``stream_readers``
    windows read at once)."""
    train: TrainBatches
    if isinstance(splits.train, ShardedSplit):
        train = StreamedTrainBatches(
            splits.train,
            global_batch,
            micro_batch,
            world_size,
            rank,
            seed,
            stream_window,
            stream_readers,
        )
    else:
        train = train_loader(
            splits.train, global_batch, micro_batch, world_size, rank, seed, num_workers, device
        )
    val, test = (
        StreamedEvalBatches(split, eval_batch, world_size, rank)
        if isinstance(split, ShardedSplit)
        else eval_loader(split, eval_batch, world_size, rank, num_workers)
        for split in (splits.val, splits.test)
    )
    sizes = {"train": len(splits.train), "val": len(splits.val), "test": len(splits.test)}
    return WorkerData(train, val, test, splits.shape, sizes, splits.skipped, splits.meta)
